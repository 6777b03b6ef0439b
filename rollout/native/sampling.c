/* Sampling without truncation on the CPU, float32: each row's draw and log-prob in one pass over
   its logits (rollout.sampler.sample's procedure, row by row; its torch version is the
   reference).

   For row r with temperature T > 0 and uniform u: s = x / T (skipped when T == 1: x / 1 == x),
   e_i = exp(s_i - max s); the token is the first i whose running sum of e exceeds u * sum(e)
   (inverse CDF in vocabulary order; if rounding puts the threshold at the total, the first token
   where the running sum reaches it), and its log-prob is s_i - max s - log(sum e), that sum in
   float64 (a float32 running sum over a large vocabulary drifts by ~1e-5). exp is a vector
   polynomial (Cephes' expf) where AVX2 + FMA exist, else expf: it may differ from torch's exp in
   the last bit, so a draw within float32 rounding of a token boundary may pick its neighbour. */

#include <math.h>
#include <stdint.h>

#include "vector_math.h"

int sampling_has_avx2(void) { return HAVE_AVX2; }


/* logits [R, V] (row stride ld), temperature [R] (> 0), uniforms [R] in [0, 1) -> tokens [R],
   logprobs [R]. scratch: R * V floats (the exps). */
void sample_rows_f32(const float *logits, int64_t ld, int64_t R, int64_t V,
                     const float *temperature, const double *uniforms, float *scratch,
                     int64_t *tokens, float *logprobs, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (R * V >= 32768) schedule(static)
  for (int64_t r = 0; r < R; r++) {
    const float *x = logits + r * ld;
    float *e = scratch + r * V;
    const float t = temperature[r];
    for (int64_t i = 0; i < V; i++) e[i] = t == 1.f ? x[i] : x[i] / t;  // s
    float m = -INFINITY;
    for (int64_t i = 0; i < V; i++) m = e[i] > m ? e[i] : m;
    int64_t i = 0;
#if HAVE_AVX2
    const __m256 vm = _mm256_set1_ps(m);
    for (; i + 8 <= V; i += 8)
      _mm256_storeu_ps(e + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(e + i), vm)));
#endif
    for (; i < V; i++) e[i] = expf(e[i] - m);
    float total = 0.f;  // running sum in vocabulary order: the cdf, as cumsum computes it
    double mass = 0.0;  // the log-prob's normaliser, summed without float32's growing error
    for (i = 0; i < V; i++) {
      total += e[i];
      mass += e[i];
    }
    const float threshold = (float)uniforms[r] * total;
    float cdf = 0.f;
    int64_t choice = V;
    for (i = 0; i < V; i++) {
      cdf += e[i];
      if (cdf > threshold) {
        choice = i;
        break;
      }
    }
    if (choice == V) {  // threshold at the total: the first token where the cdf reaches it
      cdf = 0.f;
      for (choice = 0; choice < V - 1; choice++)
        if ((cdf += e[choice]) >= total) break;
    }
    const float s_choice = t == 1.f ? x[choice] : x[choice] / t;
    tokens[r] = choice;
    logprobs[r] = (float)((double)(s_choice - m) - log(mass));
  }
}
