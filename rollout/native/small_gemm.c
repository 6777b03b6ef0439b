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

   bfloat16 on AMX tiles (built with AMX-BF16, run where CPUID and the OS grant them): the weight
   is still read in place, as the A operand (tileloadd of 16 outputs x 32 K values at the
   weight's own row stride); x^T is packed per call into the B operand's pair layout; see
   amx_outputs. Same function, same single rounding: only the float32 summation order differs.

   Without AVX-512 (the portable build) plain C loops compute the same function.

   small_gemm_prepared: the same multiply of a transform of x's rows (bfloat16): RMSNorm, or
   SiLU(gate) * up of a [M, 2K] input, by pointwise.c's own row kernels (bf16_rows.h) into a
   scratch [M, K] first: the bits of the separate element-wise kernel then small_gemm, in one
   call (a decode layer's norm -> q/k/v, norm -> gate/up and SiLU * up -> down_proj). */

#define _GNU_SOURCE  // syscall (arch_prctl for AMX) under -std=c11
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"
#include "bf16_rows.h"  // rms_norm_bf16_row, silu_mul_bf16_row: pointwise.c's row kernels

#ifdef _OPENMP
#include <omp.h>
#endif

#if HAVE_AVX512 && defined(__AVX512BF16__)
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

#include "amx_tiles.h"  // HAVE_AMX, amx_usable, amx_configure

int small_gemm_has_avx512(void) { return HAVE_AVX512; }
int small_gemm_has_bf16_dot(void) { return HAVE_BF16_DOT; }

/* Whether this CPU is Intel's: where torch's float32 GEMM (MKL's) takes its fastest kernels, and
   the engine leaves it the float32 rows past the dot-product path's (rollout/native/layers.py). */
int small_gemm_cpu_is_intel(void) {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_is("intel");
#else
  return 0;
#endif
}

/* The first row block of a tile prefetches the weight rows PREFETCH_TILES tiles ahead into L2
   (into L1 as well, _MM_HINT_T0, measured no better; without prefetch, slower). */
#define PREFETCH_TILES 4
#define PREFETCH_HINT _MM_HINT_T1

enum {
  ROWS = 4,                  // rows of x in a register tile
  COLS = 4,                  // outputs in a register tile: 16 accumulators
  PARALLEL_MACS = 1 << 15,   // below this many multiply-adds one thread does all
};

/* The team for a product of M x N x K split over `tiles` output tiles: one thread below
   PARALLEL_MACS (the fork would cost more than it saves), never more threads than tiles. */
static inline int team_size(int64_t M, int64_t N, int64_t K, int64_t tiles, int num_threads) {
  if (M * N * K < PARALLEL_MACS || num_threads < 1) num_threads = 1;
  return num_threads > tiles ? (int)tiles : num_threads;
}

/* This thread's number and the team's size inside a parallel region (0 of 1 without OpenMP). */
#ifdef _OPENMP
#define TEAM_MEMBER(t, T) const int t = omp_get_thread_num(), T = omp_get_num_threads()
#else
#define TEAM_MEMBER(t, T) const int t = 0, T = 1
#endif

/* The transforms small_gemm_prepared applies to x's rows (rollout.native.PREPARE_*). */
enum { PREPARE_RMS_NORM = 1, PREPARE_SILU_MUL = 2 };
/* Below this many transformed elements one thread prepares the rows on the AVX-512 path:
   pointwise.c's threshold, where the fork / join costs more than it saves. */
enum { PREPARE_PARALLEL_ELEMENTS = 65536 };

/* Row x (PREPARE_RMS_NORM: K elements; PREPARE_SILU_MUL: 2 K, gate then up) transformed into
   out's K elements by pointwise.c's row kernels. */
static inline void prepare_row(int prepare, const char *x, int64_t K, const void *norm_weight,
                               float eps, uint16_t *out) {
  const uint16_t *row = (const uint16_t *)x;
  if (prepare == PREPARE_RMS_NORM)
    rms_norm_bf16_row(row, norm_weight, eps, out, K);
  else
    silu_mul_bf16_row(row, row + K, out, K);
}

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

#if HAVE_AVX512
/* float32 from FP32_MIN_ROWS rows: outer products with the weight as the broadcast operand.
   x^T is packed per call (into the calling thread's scratch) in groups of up to four 16-row
   blocks, xt[g][k][16 v + i] = x[64 g + 16 v + i][k] (zero past M). A register tile of NR
   outputs x V blocks (6 x 4 for whole 64-row groups; 8 x 3, 12 x 2, 14 x 1 for the remainder
   group) keeps NR V accumulators, and each k step broadcasts the NR outputs' weights W[n + j][k]
   (read in place, each weight row sequential in k) against the V vectors xt[g][k]. Each output's
   sum is one chain of multiply-adds in k order whatever the thread count, so the threads'
   results are bitwise those of one thread. The tile is transposed in registers at the end (16 x
   16 per block) and finished as the dot-product path finishes: + bias, + residual. Threads pack
   x^T's blocks between them, then split the outputs into contiguous ranges of 16 and each
   streams its own part of the weight, prefetching the next tile's weight rows into L2. */
/* From this many rows the outer products are faster than the dot products (benchmarks/
   small_gemm.py; RESULTS.md "float32 linear layers at decode batches 17..256 on outer
   products", "float32 decode GEMMs on AMD"). The engine sends float32 batches of more rows than
   the dot products take here only where torch's own GEMM is the slower (layers.py). */
enum { FP32_MIN_ROWS = 17 };

/* The 16 x 16 float32 transpose of r in registers: r[j] lane i -> r[i] lane j. */
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // rows i, i + 1 interleaved
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + q], 128-bit lane L: rows i..i+3 of column 4L + q
    u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int q = 0; q < 4; q++) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[q], u[4 + q], 0x44);
    const __m512 v1 = _mm512_shuffle_f32x4(u[q], u[4 + q], 0xEE);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], 0x44);
    const __m512 v3 = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], 0xEE);
    r[q] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    r[4 + q] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
    r[8 + q] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    r[12 + q] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
  }
}

/* count (<= 16) elements of a row at p, widened to float32 (bfloat16: the top halves); 0 past
   them. */
static inline __attribute__((always_inline)) __m512 row_load(const void *p, __mmask16 mask,
                                                            const int bf16) {
  if (!bf16) return _mm512_maskz_loadu_ps(mask, p);
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* An outer-product tile's sums, acc[j][v] = output n + j of rows 16 (b0 + v) .. + 15 in lanes,
   transposed in registers (16 x 16 per block) into y's rows and finished as the dot products
   finish (`finish4`): + bias; float32 + residual; bfloat16 rounded once, + residual, rounded
   again. count (<= NR) outputs are stored. */
static inline __attribute__((always_inline)) void outer_tile_finish(
    __m512 acc[16][4], const int NR, const int V, int64_t b0, int64_t M, int64_t n,
    int64_t count, const void *bias, const char *res, int64_t res_row, char *y, int64_t y_row,
    const int bf16) {
  const int64_t size = bf16 ? 2 : 4;
  const __mmask16 out_mask = (__mmask16)((1u << count) - 1);
  const __m512 bv =
      bias ? row_load((const char *)bias + n * size, out_mask, bf16) : _mm512_setzero_ps();
  for (int v = 0; v < V; v++) {
    __m512 r[16];
    for (int j = 0; j < 16; j++) r[j] = j < NR ? acc[j][v] : _mm512_setzero_ps();
    transpose16(r);  // r[i]: row 16 (b0 + v) + i's outputs in lanes 0..NR-1
    const int64_t m0 = 16 * (b0 + v), rows = M - m0 < 16 ? M - m0 : 16;
    for (int64_t i = 0; i < rows; i++) {
      const int64_t m = m0 + i;
      __m512 o = bias ? _mm512_add_ps(r[i], bv) : r[i];
      const char *rm = res ? res + m * res_row + n * size : NULL;
      char *ym = y + m * y_row + n * size;
      if (!bf16) {
        if (res) o = _mm512_add_ps(o, row_load(rm, out_mask, 0));
        _mm512_mask_storeu_ps((float *)ym, out_mask, o);
        continue;
      }
      if (res) o = _mm512_add_ps(bf16_rounded16(o), row_load(rm, out_mask, 1));
      const __m512i b = _mm512_srli_epi32(_mm512_castps_si512(bf16_rounded16(o)), 16);
      _mm256_mask_storeu_epi16((uint16_t *)ym, out_mask, _mm512_cvtepi32_epi16(b));
    }
  }
}

/* Row blocks b of x^T packed: xt + b K 16, each 16 x 16 block of x transposed in registers. */
static void fp32_pack(int64_t b0, int64_t b1, int64_t step, int64_t M, int64_t K,
                      const char *x, int64_t x_row, float *xt) {
  const int64_t blocks = (M + 15) / 16;
  for (int64_t b = b0; b < b1; b += step)
    for (int64_t k = 0; k < K; k += 16) {
      const int64_t left = K - k;
      const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      __m512 r[16];
      for (int i = 0; i < 16; i++)
        r[i] = 16 * b + i < M ? _mm512_maskz_loadu_ps(m, x + (16 * b + i) * x_row + 4 * k)
                              : _mm512_setzero_ps();
      transpose16(r);
      const int64_t g = b / 4, width = blocks - 4 * g < 4 ? blocks - 4 * g : 4;
      float *out = xt + g * 64 * K + 16 * (b % 4) + 16 * width * k;
      for (int i = 0; i < (left < 16 ? left : 16); i++)
        _mm512_store_ps(out + 16 * width * i, r[i]);
    }
}

/* Rows 16 b0 .. 16 (b0 + V) - 1 by outputs n..n+count-1 (count <= NR; NR x V accumulators, V
   and NR constants at each call): the k chains, then the tile transposed 16 rows at a time into
   y's rows (+ bias, + residual). `ahead`: the byte offset of the weight rows to prefetch (a
   later tile's), 0 for none. */
static inline __attribute__((always_inline)) void fp32_tile(
    const int NR, const int V, int64_t b0, int64_t M, const float *xt, const char *w,
    int64_t w_row, int64_t K, int64_t n, int64_t count, int64_t ahead, const float *bias, const char *res, int64_t res_row, char *y, int64_t y_row) {
  const float *wj[16], *xv[4];
  for (int j = 0; j < NR; j++)  // a missing output (count < NR) repeats the last one
    wj[j] = (const float *)(w + (n + (j < count ? j : count - 1)) * w_row);
  for (int v = 0; v < V; v++) xv[v] = xt + b0 * 16 * K + 16 * v;  // b0: a multiple of 4
  __m512 acc[16][4];
  for (int j = 0; j < NR; j++)
    for (int v = 0; v < V; v++)
      acc[j][v] = _mm512_setzero_ps();
  int64_t k = 0;
  if (ahead)
    for (; k + 16 <= K; k += 16) {
      for (int j = 0; j < NR; j++) _mm_prefetch((const char *)(wj[j] + k) + ahead, _MM_HINT_T1);
      for (int64_t kk = k; kk < k + 16; kk++) {
        __m512 xk[4];
        for (int v = 0; v < V; v++) xk[v] = _mm512_load_ps(xv[v] + 16 * V * kk);
        for (int j = 0; j < NR; j++) {
          const __m512 wk = _mm512_set1_ps(wj[j][kk]);
          for (int v = 0; v < V; v++) acc[j][v] = _mm512_fmadd_ps(wk, xk[v], acc[j][v]);
        }
      }
    }
  for (; k < K; k++) {
    __m512 xk[4];
    for (int v = 0; v < V; v++) xk[v] = _mm512_load_ps(xv[v] + 16 * V * k);
    for (int j = 0; j < NR; j++) {
      const __m512 wk = _mm512_set1_ps(wj[j][k]);
      for (int v = 0; v < V; v++) acc[j][v] = _mm512_fmadd_ps(wk, xk[v], acc[j][v]);
    }
  }
  outer_tile_finish(acc, NR, V, b0, M, n, count, bias, res, res_row, y, y_row, 0);
}

/* The rows of one group of V 16-row blocks (from block b0) by outputs [n0, n1), in tiles of NR
   outputs. */
static inline __attribute__((always_inline)) void fp32_group(
    const int NR, const int V, int64_t b0, int64_t n0, int64_t n1, int64_t M, const float *xt,
    const char *w, int64_t w_row, int64_t K, const float *bias, const char *res, int64_t res_row,
    char *y, int64_t y_row) {
  for (int64_t n = n0; n < n1; n += NR) {
    const int64_t count = n1 - n < NR ? n1 - n : NR;
    // the next tile's weight rows into L2 (within this range)
    const int64_t ahead = n + 2 * NR <= n1 ? NR * w_row : 0;
    fp32_tile(NR, V, b0, M, xt, w, w_row, K, n, count, ahead, bias, res, res_row, y, y_row);
  }
}

/* Outputs [n0, n1) of all M rows from the packed x^T: 64 rows at a time on 6 x 4 tiles, the
   rows past the last whole 64 on tiles as wide in outputs as the registers allow. */
static void fp32_outputs(int64_t n0, int64_t n1, int64_t M, const float *xt, const char *w,
                         int64_t w_row, int64_t K, const float *bias, const char *res,
                         int64_t res_row, char *y, int64_t y_row) {
  const int64_t blocks = (M + 15) / 16, whole = blocks / 4 * 4;
  for (int64_t b = 0; b < whole; b += 4)
    fp32_group(6, 4, b, n0, n1, M, xt, w, w_row, K, bias, res, res_row, y, y_row);
  switch (blocks - whole) {
    case 1: fp32_group(14, 1, whole, n0, n1, M, xt, w, w_row, K, bias, res, res_row, y, y_row); break;
    case 2: fp32_group(12, 2, whole, n0, n1, M, xt, w, w_row, K, bias, res, res_row, y, y_row); break;
    case 3: fp32_group(8, 3, whole, n0, n1, M, xt, w, w_row, K, bias, res, res_row, y, y_row); break;
    default: break;
  }
}

/* The calling thread's scratch of at least `bytes` (64-byte aligned), kept between calls and
   grown when a call needs more: x^T is packed anew by every call (float32 blocks, or bfloat16
   pairs), but allocating it anew would map and fault in fresh pages each time (it is larger than
   malloc's mmap threshold). NULL where it cannot be allocated. */
static void *pack_scratch(size_t bytes) {
  static _Thread_local void *buffer = NULL;
  static _Thread_local size_t capacity = 0;
  if (bytes > capacity) {
    free(buffer);
    capacity = (bytes + 4095) / 4096 * 4096;
    buffer = aligned_alloc(64, capacity);
    if (!buffer) capacity = 0;
  }
  return buffer;
}

/* small_gemm for float32 from FP32_MIN_ROWS rows (byte strides): the threads pack x^T's row
   blocks between them, then split the 16-output tiles into contiguous ranges. 0 (nothing done)
   where the packed x^T cannot be allocated. */
static int fp32_gemm(int64_t M, int64_t N, int64_t K, const char *x, int64_t x_row,
                     const char *w, int64_t w_row, const float *bias, const char *res,
                     int64_t res_row, char *y, int64_t y_row, int num_threads) {
  const int64_t blocks = (M + 15) / 16, tiles = (N + 15) / 16;
  float *xt = pack_scratch((size_t)(blocks * K * 64));
  if (!xt) return 0;  // the caller takes the dot-product path
  num_threads = team_size(M, N, K, tiles, num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    TEAM_MEMBER(t, T);
    fp32_pack(t, blocks, T, M, K, x, x_row, xt);
#pragma omp barrier
    const int64_t n0 = tiles * t / T * 16, n1_tiles = tiles * (t + 1) / T * 16;
    fp32_outputs(n0, n1_tiles < N ? n1_tiles : N, M, xt, w, w_row, K, bias, res, res_row, y,
                 y_row);
  }
  return 1;
}

#if HAVE_BF16_DOT || HAVE_AMX
/* x^T in the pair layout (the bfloat16 outer products' and the AMX tiles' operand): xp[c][j]
   (chunk c of 32 K values, tile j of 16 rows) a 16 x 16 array
   of uint32 pairs, xp[c][j][p][i] = the pair (x[16j + i][32c + 2p], x[16j + i][32c + 2p + 1]),
   zero past K and past M: each 16 x 16 block of x's pairs transposed in registers (unpacks of
   32- and 64-bit elements within 128-bit lanes, then a 4 x 4 transpose of the lanes). */
static void pair_pack(int64_t M, int64_t K, const char *x, int64_t x_row, uint32_t *xp,
                     int64_t tiles_m, int64_t j0, int64_t j1) {  // row tiles [j0, j1)
  const int64_t chunks = (K + 31) / 32;
  for (int64_t c = 0; c < chunks; c++) {
    const int64_t left = K - 32 * c;
    const __mmask32 mask = left >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << left) - 1);
    for (int64_t j = j0; j < j1; j++) {
      __m512i r[16], t[16], u[16];
      for (int i = 0; i < 16; i++)
        r[i] = 16 * j + i < M ? _mm512_maskz_loadu_epi16(mask, x + (16 * j + i) * x_row + 64 * c)
                              : _mm512_setzero_si512();
      for (int i = 0; i < 16; i += 2) {  // t[i], t[i + 1]: rows i, i + 1 interleaved
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
      }
      for (int i = 0; i < 16; i += 4) {  // u[i + q], 128-bit lane L: rows i..i+3 of pair 4L + q
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
      }
      uint32_t *out = xp + (c * tiles_m + j) * 256;
      for (int q = 0; q < 4; q++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[q], u[4 + q], 0x44);
        const __m512i v1 = _mm512_shuffle_i32x4(u[q], u[4 + q], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0xEE);
        _mm512_store_si512(out + 16 * q, _mm512_shuffle_i32x4(v0, v2, 0x88));
        _mm512_store_si512(out + 16 * (4 + q), _mm512_shuffle_i32x4(v0, v2, 0xDD));
        _mm512_store_si512(out + 16 * (8 + q), _mm512_shuffle_i32x4(v1, v3, 0x88));
        _mm512_store_si512(out + 16 * (12 + q), _mm512_shuffle_i32x4(v1, v3, 0xDD));
      }
    }
  }
}
#endif

/* bfloat16 from BF16_MIN_ROWS rows, with vdpbf16ps: the float32 path's outer products on
   pairs. x^T is packed in the pair layout (pair_pack above), so one 64-byte
   vector holds 16 rows' pairs (x[m][k], x[m][k + 1]); each output's weight pair
   (W[n][k], W[n][k + 1]), read in place, is broadcast to all 16 lanes, and vdpbf16ps adds the
   two exact products to each row's float32 sum. A register tile of NR outputs x V 16-row tiles
   (6 x 4, and 8 x 3, 12 x 2, 14 x 1 for the rows past the last whole 64) keeps NR V sums; each
   output's sum is one chain over k in order whatever the thread count (bitwise the same on 1
   and 2 threads). The tile is transposed in registers and finished as the dot-product path
   finishes it: + bias, rounded once to bfloat16, + residual, rounded again. Like every
   vdpbf16ps path, denormal inputs and sums are flushed to zero. */
#if HAVE_BF16_DOT
/* From this many rows the outer products beat the dot products (benchmarks/small_gemm.py;
   RESULTS.md "bfloat16 decode GEMMs on AMD"). The engine sends bfloat16 batches past the dot
   products' rows here only where the CPU has no AMX tiles and is not Intel's (layers.py). */
enum { BF16_MIN_ROWS = 32 };

/* Row tiles j0 .. j0 + V - 1 by outputs n..n+count-1 (count <= NR). `ahead`: the byte offset of
   the weight rows to prefetch (a later tile's), 0 for none. */
static inline __attribute__((always_inline)) void bf16_outer_tile(
    const int NR, const int V, int64_t j0, int64_t M, const uint32_t *xp, int64_t tiles_m,
    const char *w, int64_t w_row, int64_t K, int64_t n, int64_t count, int64_t ahead,
    const uint16_t *bias, const char *res, int64_t res_row, char *y, int64_t y_row) {
  const uint16_t *wj[16];
  for (int j = 0; j < NR; j++)  // a missing output (count < NR) repeats the last one
    wj[j] = (const uint16_t *)(w + (n + (j < count ? j : count - 1)) * w_row);
  __m512 acc[16][4];
  for (int j = 0; j < NR; j++)
    for (int v = 0; v < V; v++) acc[j][v] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;  // whole pairs; an odd K's last value is a pair with 0
  for (int64_t q = 0; q < pairs; q++) {
    const int64_t c = q / 16;
    const uint32_t *xq = xp + (c * tiles_m + j0) * 256 + 16 * (q % 16);
    if (ahead && q % 16 == 0)
      for (int j = 0; j < NR; j++) _mm_prefetch((const char *)(wj[j] + 32 * c) + ahead, PREFETCH_HINT);
    __m512i xk[4];
    for (int v = 0; v < V; v++) xk[v] = _mm512_load_si512(xq + 256 * v);
    for (int j = 0; j < NR; j++) {
      uint32_t pair;
      memcpy(&pair, wj[j] + 2 * q, sizeof pair);
      const __m512bh wk = (__m512bh)_mm512_set1_epi32((int)pair);
      for (int v = 0; v < V; v++) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], wk, (__m512bh)xk[v]);
    }
  }
  if (K % 2) {  // x's pair there is (x[m][K - 1], 0): packed zero past K
    const int64_t q = pairs, c = q / 16;
    const uint32_t *xq = xp + (c * tiles_m + j0) * 256 + 16 * (q % 16);
    for (int j = 0; j < NR; j++) {
      const __m512bh wk = (__m512bh)_mm512_set1_epi32((int)wj[j][K - 1]);
      for (int v = 0; v < V; v++)
        acc[j][v] = _mm512_dpbf16_ps(acc[j][v], wk, (__m512bh)_mm512_load_si512(xq + 256 * v));
    }
  }
  outer_tile_finish(acc, NR, V, j0, M, n, count, bias, res, res_row, y, y_row, 1);
}

/* The row tiles of one group of V (from j0) by outputs [n0, n1), in tiles of NR outputs. */
static inline __attribute__((always_inline)) void bf16_outer_group(
    const int NR, const int V, int64_t j0, int64_t n0, int64_t n1, int64_t M, const uint32_t *xp,
    int64_t tiles_m, const char *w, int64_t w_row, int64_t K, const uint16_t *bias,
    const char *res, int64_t res_row, char *y, int64_t y_row) {
  for (int64_t n = n0; n < n1; n += NR) {
    const int64_t count = n1 - n < NR ? n1 - n : NR;
    const int64_t ahead = n + 2 * NR <= n1 ? NR * w_row : 0;  // the next tile's weight rows
    bf16_outer_tile(NR, V, j0, M, xp, tiles_m, w, w_row, K, n, count, ahead, bias, res, res_row,
                    y, y_row);
  }
}

/* Outputs [n0, n1) of all M rows from the packed x^T: 64 rows at a time on 6 x 4 tiles, the
   rows past the last whole 64 on tiles as wide in outputs as the registers allow. */
static void bf16_outer_outputs(int64_t n0, int64_t n1, int64_t M, const uint32_t *xp,
                               const char *w, int64_t w_row, int64_t K, const uint16_t *bias,
                               const char *res, int64_t res_row, char *y, int64_t y_row) {
  const int64_t tiles_m = (M + 15) / 16, whole = tiles_m / 4 * 4;
  for (int64_t j = 0; j < whole; j += 4)
    bf16_outer_group(6, 4, j, n0, n1, M, xp, tiles_m, w, w_row, K, bias, res, res_row, y, y_row);
  switch (tiles_m - whole) {
    case 1: bf16_outer_group(14, 1, whole, n0, n1, M, xp, tiles_m, w, w_row, K, bias, res, res_row, y, y_row); break;
    case 2: bf16_outer_group(12, 2, whole, n0, n1, M, xp, tiles_m, w, w_row, K, bias, res, res_row, y, y_row); break;
    case 3: bf16_outer_group(8, 3, whole, n0, n1, M, xp, tiles_m, w, w_row, K, bias, res, res_row, y, y_row); break;
    default: break;
  }
}

/* small_gemm for bfloat16 from BF16_MIN_ROWS rows (byte strides), on CPUs without AMX tiles:
   the threads pack x^T's row tiles between them, then split the 16-output tiles into
   contiguous ranges. 0 (nothing done) where the packed x^T cannot be allocated. */
static int bf16_outer_gemm(int64_t M, int64_t N, int64_t K, const char *x, int64_t x_row,
                           const char *w, int64_t w_row, const uint16_t *bias, const char *res,
                           int64_t res_row, char *y, int64_t y_row, int num_threads) {
  const int64_t tiles_m = (M + 15) / 16, chunks = (K + 31) / 32, tiles = (N + 15) / 16;
  uint32_t *xp = pack_scratch((size_t)(chunks * tiles_m * 1024));
  if (!xp) return 0;  // the caller takes the dot-product path
  num_threads = team_size(M, N, K, tiles, num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    TEAM_MEMBER(t, T);
    pair_pack(M, K, x, x_row, xp, tiles_m, tiles_m * t / T, tiles_m * (t + 1) / T);
#pragma omp barrier
    const int64_t n0 = tiles * t / T * 16, n1_tiles = tiles * (t + 1) / T * 16;
    bf16_outer_outputs(n0, n1_tiles < N ? n1_tiles : N, M, xp, w, w_row, K, bias, res, res_row,
                       y, y_row);
  }
  return 1;
}
#endif
#endif


#if HAVE_AMX
/* bfloat16 on AMX tiles. Tiles are 16 rows x 64 bytes: the A tile 16 outputs x 32 K values,
   loaded straight from the weight rows (stride: the weight's row stride); a B tile 16 pairs of K
   x 16 rows of x in the pair layout B[k/2][m][2] = x[m][k], x[m][k + 1] (x^T packed per call,
   zero past K and past M); a C tile C[n][m] = the 16 x 16 float32 sums, stored and read back
   transposed into y's rows. Tile numbers are immediates: C tiles 0-3 (up to 64 rows of x at a
   time), A 4, B 5. Outputs past the last whole 16 go to the AVX-512 path (`outputs`); the K
   values past the last whole 32 of a tile's weight rows are copied, zero-padded, into a 16 x 32
   staging tile (tileloadd would read past the rows' ends otherwise). Each thread configures its
   tiles (amx_tiles.h: amx_configure) and releases them after. */
/* From this many rows of x the tiles are faster than the AVX-512 path (benchmarks/small_gemm.py,
   RESULTS.md "bfloat16 small-batch linear layers on AMX tiles"). */
enum { AMX_MIN_ROWS = 8 };

/* A C tile's outputs: c[o][i] the float32 sum of output n + o for row i (of `rows` <= 16), as
   _tile_stored wrote it. Each of C's rows (one output, 16 rows of x) gets its bias and is
   rounded to bfloat16 as it lies; the 16 x 16 bfloat16 block is then transposed in registers
   into y's rows (which are the rows of x), where the residual, if any, is added and the sum
   rounded again. Rounding is element by element, so this is bitwise the rounding of each
   row's sums after a transpose of the float32 tile (a gather of each column of C, which costs
   more: 16 gathered floats per row against a word transpose per two rows). */
static inline __attribute__((always_inline)) void amx_finish_tile(
    const float *c, int64_t rows, int64_t n, const uint16_t *bias, const char *res,
    int64_t res_row, char *y, int64_t y_row) {
  // the high (bfloat16) halves of two vectors of rounded floats: a's 16, then b's 16
  const __m512i high_words = _mm512_set_epi16(
      63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
      31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  /* p[k]: C's rows 2k, 2k + 1 (outputs n + 2k, n + 2k + 1), 16 words each, rounded by
     vcvtne2ps2bf16: to nearest even, as bf16_rounded16, except that it keeps a NaN's sign and
     payload and flushes denormals to zero. A tile with any NaN or denormal sum is rounded
     again by bf16_rounded16's arithmetic, so the words are always bf16_round's. */
  __m512i p[8];
  __mmask16 special = 0;
  for (int k = 0; k < 8; k++) {
    __m512 a = _mm512_load_ps(c + 32 * k), b = _mm512_load_ps(c + 32 * k + 16);
    if (bias) {
      a = _mm512_add_ps(a, _mm512_set1_ps(bf16_load(bias[n + 2 * k])));
      b = _mm512_add_ps(b, _mm512_set1_ps(bf16_load(bias[n + 2 * k + 1])));
    }
    // fpclass 0xA1: quiet NaN, denormal, signalling NaN
    special |= _mm512_fpclass_ps_mask(a, 0xA1) | _mm512_fpclass_ps_mask(b, 0xA1);
    p[k] = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a's words first
  }
  if (special)
    for (int k = 0; k < 8; k++) {
      __m512 a = _mm512_load_ps(c + 32 * k), b = _mm512_load_ps(c + 32 * k + 16);
      if (bias) {
        a = _mm512_add_ps(a, _mm512_set1_ps(bf16_load(bias[n + 2 * k])));
        b = _mm512_add_ps(b, _mm512_set1_ps(bf16_load(bias[n + 2 * k + 1])));
      }
      p[k] = _mm512_permutex2var_epi16(_mm512_castps_si512(bf16_rounded16(a)), high_words,
                                       _mm512_castps_si512(bf16_rounded16(b)));
    }
  /* The transpose: p[r] holds the word (o, i) (output o, row i) at register r = o >> 1, word
     (o & 1) << 4 | i; q[r] must hold it at r = i >> 1, word (i & 1) << 4 | o. Three stages
     each combine the registers that differ in one bit of r: stage 0 (dwords) and 1 (qwords)
     swap r's bits 0 and 1 (o's bits 1 and 2) with the word's bits 1 and 2 (i's bits 1 and 2),
     stage 2 (words) r's bit 2 with i's bit 3 and puts each word where q wants it. */
  const __m512i lo0 = _mm512_set_epi32(30, 14, 28, 12, 26, 10, 24, 8, 22, 6, 20, 4, 18, 2, 16, 0);
  const __m512i hi0 = _mm512_set_epi32(31, 15, 29, 13, 27, 11, 25, 9, 23, 7, 21, 5, 19, 3, 17, 1);
  const __m512i lo1 = _mm512_set_epi64(14, 6, 12, 4, 10, 2, 8, 0);
  const __m512i hi1 = _mm512_set_epi64(15, 7, 13, 5, 11, 3, 9, 1);
  const __m512i lo2 = _mm512_set_epi16(
      55, 39, 53, 37, 51, 35, 49, 33, 23, 7, 21, 5, 19, 3, 17, 1,
      54, 38, 52, 36, 50, 34, 48, 32, 22, 6, 20, 4, 18, 2, 16, 0);
  const __m512i hi2 = _mm512_set_epi16(
      63, 47, 61, 45, 59, 43, 57, 41, 31, 15, 29, 13, 27, 11, 25, 9,
      62, 46, 60, 44, 58, 42, 56, 40, 30, 14, 28, 12, 26, 10, 24, 8);
  __m512i t[8], q[8];
  for (int r = 0; r < 8; r += 2) {
    t[r] = _mm512_permutex2var_epi32(p[r], lo0, p[r + 1]);
    t[r + 1] = _mm512_permutex2var_epi32(p[r], hi0, p[r + 1]);
  }
  for (int h = 0; h < 4; h++) {
    const int r = (h & 1) | (h & 2) << 1;  // 0, 1, 4, 5
    p[r] = _mm512_permutex2var_epi64(t[r], lo1, t[r + 2]);
    p[r + 2] = _mm512_permutex2var_epi64(t[r], hi1, t[r + 2]);
  }
  for (int r = 0; r < 4; r++) {
    q[r] = _mm512_permutex2var_epi16(p[r], lo2, p[r + 4]);
    q[r + 4] = _mm512_permutex2var_epi16(p[r], hi2, p[r + 4]);
  }
  // q[r]: rows 2r, 2r + 1, each its 16 outputs
  for (int64_t i = 0; i < rows; i++) {
    const __m512i two = q[i >> 1];
    __m256i out = i & 1 ? _mm512_extracti64x4_epi64(two, 1) : _mm512_castsi512_si256(two);
    uint16_t *yi = (uint16_t *)(y + i * y_row) + n;
    if (res) {
      const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(out), 16));
      bf16_store16(yi, _mm512_add_ps(v, bf16_load16((const uint16_t *)(res + i * res_row) + n)));
    } else {
      _mm256_storeu_si256((__m256i *)yi, out);
    }
  }
}

/* Outputs [n0, n1) (whole tiles of 16) of all M rows on tiles, x^T packed in xp: for each
   weight tile (16 outputs), passes of up to 4 row tiles (64 rows of x), 4 C tiles each.

   A pass's C tiles are stored to `c` at its end and finished (amx_finish_tile) one per K step
   during the next pass's products: the vector work then runs beside the tile unit, where
   finishing them all at once left it idle. Each C tile sums its K chunks in order, as before.
   (The row tiles outer, so that a pass's packed x^T stays in L1 across the weight tiles, was
   measured no better on 2 threads, worse at N = 384: RESULTS.md.) */
static void amx_outputs(int64_t n0, int64_t n1, int64_t j_begin, int64_t j_end, int64_t M,
                        const uint32_t *xp, int64_t tiles_m, const char *w, int64_t w_row,
                        int64_t K, const void *bias, const char *res, int64_t res_row, char *y,
                        int64_t y_row) {
  const int64_t whole = K / 32, tail = K - 32 * whole, chunks = whole + (tail > 0);
  uint16_t staged[16 * 32] __attribute__((aligned(64)));
  float c[4][16 * 16] __attribute__((aligned(64)));
  // the pass whose C tiles wait in c: its outputs, first row tile, tiles and those finished
  int64_t waiting_n = 0, waiting_j0 = 0, waiting = 0, finished = 0;
#define FINISH_ONE()                                                                        \
  do {                                                                                      \
    const int64_t m0 = 16 * (waiting_j0 + finished), rows = M - m0 < 16 ? M - m0 : 16;      \
    amx_finish_tile(c[finished], rows, waiting_n, (const uint16_t *)bias,                   \
                    res ? res + m0 * res_row : NULL, res_row, y + m0 * y_row, y_row);       \
    finished++;                                                                             \
  } while (0)
  for (int64_t n = n0; n < n1; n += 16) {
    const char *wn = w + n * w_row;
    // the next tile's weight rows into L2 while this one's are multiplied (within the range)
    const char *next = n + 32 <= n1 ? wn + 16 * w_row : NULL;
    if (tail) {
      const __mmask32 mask = (__mmask32)((1u << tail) - 1);
      for (int r = 0; r < 16; r++)
        _mm512_store_si512(staged + 32 * r,
                           _mm512_maskz_loadu_epi16(mask, wn + r * w_row + 64 * whole));
    }
    for (int64_t j0 = j_begin; j0 < j_end; j0 += 4) {
      const int64_t nj = j_end - j0 < 4 ? j_end - j0 : 4;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < chunks; k++) {
        if (k < whole) {
          _tile_loadd(4, wn + 64 * k, w_row);
          if (next && j0 == j_begin)
            for (int r = 0; r < 16; r++) _mm_prefetch(next + r * w_row + 64 * k, _MM_HINT_T1);
        } else {
          _tile_loadd(4, staged, 64);
        }
        const uint32_t *b = xp + (k * tiles_m + j0) * 256;
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (nj > 1) {
          _tile_loadd(5, b + 256, 64);
          _tile_dpbf16ps(1, 4, 5);
        }
        if (nj > 2) {
          _tile_loadd(5, b + 512, 64);
          _tile_dpbf16ps(2, 4, 5);
        }
        if (nj > 3) {
          _tile_loadd(5, b + 768, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
        if (finished < waiting) FINISH_ONE();
      }
      while (finished < waiting) FINISH_ONE();
      _tile_stored(0, c[0], 64);
      if (nj > 1) _tile_stored(1, c[1], 64);
      if (nj > 2) _tile_stored(2, c[2], 64);
      if (nj > 3) _tile_stored(3, c[3], 64);
      waiting_n = n, waiting_j0 = j0, waiting = nj, finished = 0;
    }
  }
  while (finished < waiting) FINISH_ONE();
#undef FINISH_ONE
}

/* From this many row tiles a thread (2 threads: from 128 rows) the threads split the rows of
   x, each all the outputs of its own row tiles: each then packs and reads only its own x^T
   (its panel of 4 row tiles, 32 KiB at K = 256, stays near; no barrier between the pack and
   the products) and the threads share the weight reads. Below it they split the outputs. */
enum { AMX_ROW_SPLIT_TILES = 4 };

/* One thread's part of amx_gemm / amx_gemm_prepared: x's rows (transformed by `prepare`, into
   `rows`, where prepare is not 0) packed into xp for its row tiles, then its outputs. */
static void amx_thread(int t, int T, int prepare, int64_t M, int64_t N, int64_t K, const char *x,
                       int64_t x_row, const void *norm_weight, float eps, uint16_t *rows,
                       uint32_t *xp, const char *w, int64_t w_row, const void *bias,
                       const char *res, int64_t res_row, char *y, int64_t y_row) {
  const int64_t tiles_m = (M + 15) / 16, tiles = N / 16;
  const int split_rows = T > 1 && tiles_m >= AMX_ROW_SPLIT_TILES * T;
  const int64_t j0 = tiles_m * t / T, j1 = tiles_m * (t + 1) / T;
  const int64_t m0 = 16 * j0, m1 = 16 * j1 < M ? 16 * j1 : M;
  if (prepare) {
    for (int64_t m = m0; m < m1; m++)
      prepare_row(prepare, x + m * x_row, K, norm_weight, eps, rows + m * K);
    x = (const char *)rows, x_row = 2 * K;
  }
  pair_pack(M, K, x, x_row, xp, tiles_m, j0, j1);
  if (!split_rows) {
#pragma omp barrier
  }
  amx_configure();
  if (split_rows)
    amx_outputs(0, tiles * 16, j0, j1, M, xp, tiles_m, w, w_row, K, bias, res, res_row, y,
                y_row);
  else
    amx_outputs(tiles * t / T * 16, tiles * (t + 1) / T * 16, 0, tiles_m, M, xp, tiles_m, w,
                w_row, K, bias, res, res_row, y, y_row);
  _tile_release();
  if (tiles * 16 < N) {  // the outputs past the last whole 16 on the AVX-512 path
    if (split_rows)
      outputs(tiles * 16, N, m1 - m0, x + m0 * x_row, x_row, w, w_row, K, bias,
              res ? res + m0 * res_row : NULL, res_row, y + m0 * y_row, y_row, 1);
    else if (t == T - 1)
      outputs(tiles * 16, N, M, x, x_row, w, w_row, K, bias, res, res_row, y, y_row, 1);
  }
}

/* small_gemm for bfloat16 on tiles (byte strides), and of x's rows transformed
   (small_gemm_prepared: `prepare` PREPARE_*, the scratch `rows` [M, K]; 0 for none): in one
   parallel region, each thread transforms and packs its share of x's 16-row tiles (amx_thread),
   then computes its outputs; the last thread's (or each thread's rows') outputs past the last
   whole 16 on the AVX-512 path. Whichever way the threads split the work, every C tile sums its
   K chunks in order: bitwise the same on 1 and 2 threads. 0 (nothing done) where the packed x^T
   cannot be allocated. */
static int amx_gemm_any(int prepare, int64_t M, int64_t N, int64_t K, const char *x,
                        int64_t x_row, const void *norm_weight, float eps, uint16_t *rows,
                        const char *w, int64_t w_row, const void *bias, const char *res,
                        int64_t res_row, char *y, int64_t y_row, int num_threads) {
  const int64_t tiles_m = (M + 15) / 16, chunks = (K + 31) / 32, tiles = N / 16;
  uint32_t *xp = aligned_alloc(64, (size_t)(chunks * tiles_m * 1024));
  if (!xp) return 0;  // the caller takes the AVX-512 path
  num_threads = team_size(M, N, K, tiles, num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    TEAM_MEMBER(t, T);
    amx_thread(t, T, prepare, M, N, K, x, x_row, norm_weight, eps, rows, xp, w, w_row, bias, res,
               res_row, y, y_row);
  }
  free(xp);
  return 1;
}

static int amx_gemm(int64_t M, int64_t N, int64_t K, const char *x, int64_t x_row,
                    const char *w, int64_t w_row, const void *bias, const char *res,
                    int64_t res_row, char *y, int64_t y_row, int num_threads) {
  return amx_gemm_any(0, M, N, K, x, x_row, NULL, 0.f, NULL, w, w_row, bias, res, res_row, y,
                      y_row, num_threads);
}

static int amx_gemm_prepared(int prepare, int64_t M, int64_t N, int64_t K, const char *x,
                             int64_t x_row, const void *norm_weight, float eps, uint16_t *rows,
                             const char *w, int64_t w_row, const void *bias, const char *res,
                             int64_t res_row, char *y, int64_t y_row, int num_threads) {
  return amx_gemm_any(prepare, M, N, K, x, x_row, norm_weight, eps, rows, w, w_row, bias, res,
                      res_row, y, y_row, num_threads);
}
#endif

/* Whether bfloat16 runs on AMX tiles here (built with them, and the CPU and OS allow). */
int small_gemm_has_amx(void) {
#if HAVE_AMX
  return amx_usable();
#else
  return 0;
#endif
}

/* y = x W^T (+ bias) (+ residual). x [M, K], residual and y [M, N]: rows of contiguous elements,
   row strides in elements; w [N, K]: each output's K weights contiguous, w_row elements apart;
   bias [N] contiguous or NULL; residual NULL for none. bf16: every tensor bfloat16, else all
   float32. */
void small_gemm(int64_t M, int64_t N, int64_t K, const void *x, int64_t x_row, const void *w,
                int64_t w_row, const void *bias, const void *res, int64_t res_row, void *y,
                int64_t y_row, int bf16, int num_threads) {
  const int64_t size = bf16 ? 2 : 4;
#if HAVE_AMX
  if (bf16 && N >= 16 && M >= AMX_MIN_ROWS && amx_usable() &&
      amx_gemm(M, N, K, x, x_row * size, w, w_row * size, bias, res, res_row * size, y,
               y_row * size, num_threads))
    return;
#endif
#if HAVE_BF16_DOT
  if (bf16 && M >= BF16_MIN_ROWS &&
      bf16_outer_gemm(M, N, K, x, x_row * size, w, w_row * size, bias, res, res_row * size, y,
                      y_row * size, num_threads))
    return;
#endif
#if HAVE_AVX512
  if (!bf16 && M >= FP32_MIN_ROWS &&
      fp32_gemm(M, N, K, x, x_row * size, w, w_row * size, bias, res, res_row * size, y,
                y_row * size, num_threads))
    return;
#endif
  const int64_t tiles = (N + COLS - 1) / COLS;
  num_threads = team_size(M, N, K, tiles, num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    TEAM_MEMBER(t, T);
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

/* small_gemm (bfloat16) of x's rows transformed: PREPARE_RMS_NORM: x [M, K], each row
   `rms_norm_bf16_row` with norm_weight [K] and eps (the bits of pointwise.c's rms_norm_bf16);
   PREPARE_SILU_MUL: x [M, 2K], each row's halves `silu_mul_bf16_row` (gate, then up: the bits
   of silu_mul_bf16 on the halves; norm_weight unused). The rows go into a scratch [M, K], then
   small_gemm multiplies it with every other argument as given: y is bitwise the separate
   transform then small_gemm. Returns 0, or -1 (nothing written) where the scratch cannot be
   allocated or `prepare` is unknown. */
int small_gemm_prepared(int64_t M, int64_t N, int64_t K, int prepare, const void *x,
                        int64_t x_row, const void *norm_weight, float eps, const void *w,
                        int64_t w_row, const void *bias, const void *res, int64_t res_row,
                        void *y, int64_t y_row, int num_threads) {
  if (prepare != PREPARE_RMS_NORM && prepare != PREPARE_SILU_MUL) return -1;
  uint16_t *rows = malloc(sizeof(uint16_t) * (size_t)(M * K > 0 ? M * K : 1));
  if (!rows) return -1;
#if HAVE_AMX
  // small_gemm's AMX condition: there the transform and the pack run in the multiply's region
  if (N >= 16 && M >= AMX_MIN_ROWS && amx_usable() &&
      amx_gemm_prepared(prepare, M, N, K, x, 2 * x_row, norm_weight, eps, rows, w, 2 * w_row,
                        bias, res, 2 * res_row, y, 2 * y_row, num_threads)) {
    free(rows);
    return 0;
  }
#endif
  const char *xs = x;
#pragma omp parallel for num_threads(num_threads) if (M * K >= PREPARE_PARALLEL_ELEMENTS) schedule(static)
  for (int64_t m = 0; m < M; m++)
    prepare_row(prepare, xs + 2 * m * x_row, K, norm_weight, eps, rows + m * K);
  small_gemm(M, N, K, rows, K, w, w_row, bias, res, res_row, y, y_row, 1, num_threads);
  free(rows);
  return 0;
}
