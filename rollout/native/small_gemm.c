/* Linear layers over few rows on the CPU (the decode steps' batches): y[M, N] = x[M, K] W^T
   (+ bias[N]) (+ residual[M, N]), float32, or bfloat16 with float32 accumulation: the function of
   torch's F.linear / addmm on the same inputs (rollout.native.small_linear, the tests' reference).

   The weight is read where the model keeps it: [N, K] (an nn.Linear's [out, in]), each output's
   K weights one contiguous run, any stride between outputs. It is never packed (a weight sync
   writes it in place; a packed copy would make every sync a reorder). That layout makes every
   output a dot product along K: a register tile of ROWS rows of x by COLS outputs keeps
   ROWS x COLS accumulators of 16 float32 lanes, each fed by one 64-byte chunk of x and of the
   weight per step, and is summed across its lanes once at the end. The COLS weight rows of a
   tile are read once from memory by its first row block (software prefetch a few tiles ahead:
   in the engine the weights are never in cache, the K/V reads between layers evict them) and
   from L1 by the next ones; x stays in L1 throughout. The threads split the outputs into
   contiguous ranges of whole tiles, so each streams its own part of the weight.

   bfloat16: with AVX-512 BF16, vdpbf16ps multiplies pairs of consecutive elements along K (exact
   products, float32 sums) straight from the stored rows of x and W; otherwise both are widened
   exactly to float32. The sum (+ bias) is rounded to bfloat16 once, as torch's bfloat16 linear
   rounds its float32-accumulated result; a residual is added to that rounded value and the sum
   rounded again, as `x + linear(inputs)` rounds. float32: the residual is added to the sum
   (+ bias) as addmm(residual, x, W^T) does. Results differ from torch's in float32 summation
   order only (and vdpbf16ps flushes denormal inputs and results to zero).

   Without AVX-512 (the portable build) plain C loops compute the same function. */

#include <stddef.h>
#include <stdint.h>

#include "vector_math.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if HAVE_AVX512 && defined(__AVX512BF16__)
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

int small_gemm_has_avx512(void) { return HAVE_AVX512; }
int small_gemm_has_bf16_dot(void) { return HAVE_BF16_DOT; }

/* The first row block of a tile prefetches the weight rows PREFETCH_TILES tiles ahead into L2
   (into L1 as well, _MM_HINT_T0, measured no better; without prefetch, slower). */
#define PREFETCH_TILES 4
#define PREFETCH_HINT _MM_HINT_T1

enum {
  ROWS = 4,                  // rows of x in a register tile
  COLS = 4,                  // outputs in a register tile: 16 accumulators
  PARALLEL_MACS = 1 << 15,   // below this many multiply-adds one thread does all
};

static inline __attribute__((always_inline)) float element(const void *p, int64_t i,
                                                          const int bf16) {
  return bf16 ? bf16_load(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#if HAVE_AVX512
/* The elements of one step of the dot products: 16 float32, 16 bfloat16 widened, or (with
   vdpbf16ps) 32 bfloat16 as they are stored. */
#define STEP(bf16) ((bf16) && HAVE_BF16_DOT ? 32 : 16)

/* One step's chunk of a row: the first `count` elements of the step from p (the rest 0). */
static inline __attribute__((always_inline)) __m512 chunk(const void *p, int64_t count,
                                                         const int bf16) {
  if (!bf16) {
    const __mmask16 m = count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
    return _mm512_maskz_loadu_ps(m, p);
  }
  if (HAVE_BF16_DOT) {
    const __mmask32 m = count >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << count) - 1);
    return _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(m, p));
  }
  const __mmask16 m = count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
  __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

static inline __attribute__((always_inline)) __m512 multiply_add(__m512 acc, __m512 x, __m512 w,
                                                                const int bf16) {
#if HAVE_BF16_DOT
  if (bf16) return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
#endif
  return _mm512_fmadd_ps(x, w, acc);
}

/* [sum of a's lanes, of b's, of c's, of d's]. */
static inline __attribute__((always_inline)) __m128 lane_sums4(__m512 a, __m512 b, __m512 c,
                                                              __m512 d) {
  // 128-bit quarters: ab = [a0 + a2, a1 + a3, b0 + b2, b1 + b3], cd likewise
  __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  // t's quarters: one each of a, b, c, d (four floats to add)
  __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));  // each quarter's sum in all its lanes
  const __m512i firsts = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, t));
}

/* The first `count` (1..4) bfloat16 elements at p widened to float32 (lanes 0..3; the rest 0). */
static inline __attribute__((always_inline)) __m512 bf16_load4(const uint16_t *p, __mmask8 m) {
  __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_maskz_loadu_epi16(m, p)), 16);
  return _mm512_zextps256_ps512(_mm256_castsi256_ps(w));
}

/* The first `count` (1..4) outputs of a row from their float32 sums s: + bias, rounded to the
   output dtype, + residual (rounded again in bfloat16), stored at y[n..]. */
static inline __attribute__((always_inline)) void finish4(__m128 s, int64_t count, int64_t n,
                                                         const void *bias, const void *res,
                                                         void *y, const int bf16) {
  const __mmask8 m = (__mmask8)((1u << count) - 1);
  if (!bf16) {
    if (bias) s = _mm_add_ps(s, _mm_maskz_loadu_ps(m, (const float *)bias + n));
    if (res) s = _mm_add_ps(s, _mm_maskz_loadu_ps(m, (const float *)res + n));
    _mm_mask_storeu_ps((float *)y + n, m, s);
    return;
  }
  __m512 v = _mm512_zextps128_ps512(s);
  if (bias) v = _mm512_add_ps(v, bf16_load4((const uint16_t *)bias + n, m));
  if (res) v = _mm512_add_ps(bf16_rounded16(v), bf16_load4((const uint16_t *)res + n, m));
  __m512i b = _mm512_srli_epi32(_mm512_castps_si512(bf16_rounded16(v)), 16);
  _mm_mask_storeu_epi16((uint16_t *)y + n, m, _mm256_castsi256_si128(_mm512_cvtepi32_epi16(b)));
}

/* Rows m0..m0+R-1 (R <= ROWS, a constant at each call) by outputs n..n+count-1 (count <= COLS):
   the tile's dot products over K, then its outputs. `ahead`: the byte offset of the weight rows
   to prefetch (a later tile's), 0 for none. */
static inline __attribute__((always_inline)) void tile(
    const int R, const char *x, int64_t x_row, const char *w, int64_t w_row, int64_t K,
    int64_t n, int64_t count, int64_t ahead, const void *bias, const char *res, int64_t res_row,
    char *y, int64_t y_row, const int bf16) {
  const int64_t size = bf16 ? 2 : 4, step = STEP(bf16);
  const char *wj[COLS];
  for (int j = 0; j < COLS; j++)  // a missing output (count < COLS) repeats the last one
    wj[j] = w + (n + (j < count ? j : count - 1)) * w_row;
  __m512 acc[ROWS][COLS];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < COLS; j++) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += step) {
    const int64_t left = K - k;
    __m512 xv[ROWS];
    for (int r = 0; r < R; r++) xv[r] = chunk(x + r * x_row + k * size, left, bf16);
    for (int j = 0; j < COLS; j++) {
      const __m512 wv = chunk(wj[j] + k * size, left, bf16);
      if (ahead) _mm_prefetch(wj[j] + k * size + ahead, PREFETCH_HINT);
      for (int r = 0; r < R; r++) acc[r][j] = multiply_add(acc[r][j], xv[r], wv, bf16);
    }
  }
  for (int r = 0; r < R; r++)
    finish4(lane_sums4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), count, n, bias,
            res ? res + r * res_row : NULL, y + r * y_row, bf16);
}

/* Outputs [n0, n1) of all M rows: tile by tile, each tile's weight rows streamed once. */
static inline __attribute__((always_inline)) void outputs(
    int64_t n0, int64_t n1, int64_t M, const char *x, int64_t x_row, const char *w,
    int64_t w_row, int64_t K, const void *bias, const char *res, int64_t res_row, char *y,
    int64_t y_row, const int bf16) {
  for (int64_t n = n0; n < n1; n += COLS) {
    const int64_t count = n1 - n < COLS ? n1 - n : COLS;
    // prefetch within this range only (another thread streams the rest)
    const int64_t ahead = n + (PREFETCH_TILES + 1) * COLS <= n1 ? PREFETCH_TILES * COLS * w_row : 0;
    for (int64_t m = 0; m < M; m += ROWS) {
      const char *xm = x + m * x_row, *rm = res ? res + m * res_row : NULL;
      char *ym = y + m * y_row;
      const int64_t pf = m == 0 ? ahead : 0;
      switch (M - m < ROWS ? M - m : ROWS) {
        case 1: tile(1, xm, x_row, w, w_row, K, n, count, pf, bias, rm, res_row, ym, y_row, bf16); break;
        case 2: tile(2, xm, x_row, w, w_row, K, n, count, pf, bias, rm, res_row, ym, y_row, bf16); break;
        case 3: tile(3, xm, x_row, w, w_row, K, n, count, pf, bias, rm, res_row, ym, y_row, bf16); break;
        default: tile(4, xm, x_row, w, w_row, K, n, count, pf, bias, rm, res_row, ym, y_row, bf16);
      }
    }
  }
}
#else
static inline __attribute__((always_inline)) void outputs(
    int64_t n0, int64_t n1, int64_t M, const char *x, int64_t x_row, const char *w,
    int64_t w_row, int64_t K, const void *bias, const char *res, int64_t res_row, char *y,
    int64_t y_row, const int bf16) {
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = n0; n < n1; n++) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; k++)
        acc += element(x + m * x_row, k, bf16) * element(w + n * w_row, k, bf16);
      if (bias) acc += element(bias, n, bf16);
      if (bf16) {
        if (res) acc = bf16_rounded(acc) + element(res + m * res_row, n, 1);
        ((uint16_t *)(y + m * y_row))[n] = bf16_round(acc);
      } else {
        if (res) acc += ((const float *)(res + m * res_row))[n];
        ((float *)(y + m * y_row))[n] = acc;
      }
    }
}
#endif

/* y = x W^T (+ bias) (+ residual). x [M, K], residual and y [M, N]: rows of contiguous elements,
   row strides in elements; w [N, K]: each output's K weights contiguous, w_row elements apart;
   bias [N] contiguous or NULL; residual NULL for none. bf16: every tensor bfloat16, else all
   float32. */
void small_gemm(int64_t M, int64_t N, int64_t K, const void *x, int64_t x_row, const void *w,
                int64_t w_row, const void *bias, const void *res, int64_t res_row, void *y,
                int64_t y_row, int bf16, int num_threads) {
  const int64_t size = bf16 ? 2 : 4;
  const int64_t tiles = (N + COLS - 1) / COLS;
  if (M * N * K < PARALLEL_MACS || num_threads < 1) num_threads = 1;
  if (num_threads > tiles) num_threads = (int)tiles;
#pragma omp parallel num_threads(num_threads)
  {
#ifdef _OPENMP
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
    const int t = 0, T = 1;
#endif
    // contiguous ranges of whole tiles, one per thread
    const int64_t n0 = tiles * t / T * COLS, n1_tiles = tiles * (t + 1) / T * COLS;
    const int64_t n1 = n1_tiles < N ? n1_tiles : N;
    if (bf16)
      outputs(n0, n1, M, x, x_row * size, w, w_row * size, K, bias, res, res_row * size, y,
              y_row * size, 1);
    else
      outputs(n0, n1, M, x, x_row * size, w, w_row * size, K, bias, res, res_row * size, y,
              y_row * size, 0);
  }
}
