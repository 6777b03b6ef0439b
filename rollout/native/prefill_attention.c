/* Causal prefill attention on the CPU, float32 or bfloat16 inputs, float32 arithmetic: the
   function of torch's scaled_dot_product_attention(q, k, v, attn_mask=causal aligned to the
   context's end, enable_gqa=True) (rollout.attention.prefill_attention's torch path, the
   test's reference).

   `count` chunks of n query tokens, each over its own context of C keys (C >= n: the last n
   keys are the chunk's own tokens, the first C - n a cached prefix); query i of a chunk sees
   keys j <= C - n + i. H query heads read Hkv K/V heads, query head a reading KV head
   a / (H / Hkv).

   A work item is (chunk, KV head, block of BQ query tokens, about 128 / g): its rows are those tokens x the
   g = H / Hkv query heads that read the KV head, so every K and V row loaded serves g * BQ
   query rows. The item walks its visible keys in blocks of BK with an online softmax (running
   row maximum m and sum l, the output rescaled by e^(m_old - m_new) when the maximum grows):
   no [n, C] score matrix exists. K / V blocks are converted to float32 once per item block
   (K transposed, so that the score micro-kernel broadcasts one q element against 16 keys).
   Items are handed out heaviest first (the last query blocks see the most keys). With
   AVX-512 a panel of 6 rows keeps its block of scores in registers through the mask and the
   softmax update (qk_softmax), and the 16-key vectors of a diagonal block past its last
   visible key are not computed; the operations and their order are those of the separate
   passes (scores, mask, softmax_step), so the results are bitwise the same.

   With AVX-512 (-march=native on a machine that has it) the products are vector code and exp
   is a vector polynomial (Cephes' expf, ~1 ulp); with AVX-512 BF16 too, bfloat16 scores come
   from vdpbf16ps on the stored pairs (each bfloat16 product is exact in float32, so only the
   order of the float32 sums differs), K transposed by 32-bit pairs instead of widened;
   elsewhere, or for head sizes that are not a multiple of 16, plain C loops compute the same
   function. Results differ from torch's in
   float32 rounding only (for bfloat16, torch's kernel also rounds the probabilities to
   bfloat16 before the PV product; this one keeps them in float32).

   Built with AMX-BF16 (-march=native on a CPU that has it) and run where the OS grants the
   tiles, bfloat16 items of head sizes 32, 64, 96 or 128 take item_amx instead: Q K^T and P V as
   tile products, with P rounded to bfloat16 like torch's kernel (see item_amx). */

#define _GNU_SOURCE  // syscall (arch_prctl for AMX) under -std=c11
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

#if HAVE_AVX512 && defined(__AVX512BF16__)
#define HAVE_BF16_DOT 1  // vdpbf16ps: two bfloat16 products a float32 lane, products exact
#else
#define HAVE_BF16_DOT 0
#endif

#include "amx_tiles.h"  // HAVE_AMX, amx_usable, amx_configure, FOR_TILES

int prefill_attention_has_avx512(void) { return HAVE_AVX512; }

enum { BK = 64 };

/* Element i of a row of float32 (bf16 == 0) or bfloat16 values, as float32. */
static inline float load_at(const void *p, int64_t i, int bf16) {
  return bf16 ? bf16_load(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Per-thread buffers of an item of at most `rows` query rows. */
typedef struct {
  float *q;   // [rows, Dh] the item's query rows times the softmax scale
  float *kt;  // [Dh, BK] a key block transposed, keys past the block's end zero
  float *v;   // [BK, Dh] a value block, rows past the block's end zero
  float *s;   // [rows, BK] scores, then probabilities
  float *o;   // [rows, Dh] unnormalised outputs
  float *m;   // [rows] running maxima
  float *l;   // [rows] running sums
  float *alpha;  // [rows] the output's rescale factors of the current key block
  int64_t *lim;  // [rows] the current key block's keys each row sees (a prefix of the block)
  uint16_t *p;   // [rows, BK] bfloat16 probabilities (item_amx)
} buffers;

#if HAVE_AVX512
/* s[r][0..BK) = <q_r, keys> for RB rows (q [RB, Dh], kt [Dh, BK]): 4 x RB accumulators, each
   K vector loaded once for the RB rows. */
static inline __attribute__((always_inline)) void qk_block(const int RB, const int64_t Dh,
                                                           const float *q, const float *kt,
                                                           float *s) {
  __m512 a[6][4];
  for (int r = 0; r < RB; r++)
    for (int c = 0; c < 4; c++) a[r][c] = _mm512_setzero_ps();
  for (int64_t x = 0; x < Dh; x++) {
    __m512 k[4];
    for (int c = 0; c < 4; c++) k[c] = _mm512_loadu_ps(kt + x * BK + 16 * c);
    for (int r = 0; r < RB; r++) {
      const __m512 vq = _mm512_set1_ps(q[r * Dh + x]);
      for (int c = 0; c < 4; c++) a[r][c] = _mm512_fmadd_ps(vq, k[c], a[r][c]);
    }
  }
  for (int r = 0; r < RB; r++)
    for (int c = 0; c < 4; c++) _mm512_storeu_ps(s + r * BK + 16 * c, a[r][c]);
}

/* o[r][0 .. NV * 16) += sum over t < nk of p[r][t] v[t][0 .. NV * 16) for RB rows (o and v
   rows Dh apart, p rows BK apart): each V vector loaded once for the RB rows. */
static inline __attribute__((always_inline)) void pv_block(const int RB, const int NV,
                                                           const int64_t Dh, const float *p,
                                                           const float *v, int64_t nk, float *o,
                                                           const float *alpha) {
  __m512 acc[8][2];
  for (int r = 0; r < RB; r++) {
    const __m512 a = _mm512_set1_ps(alpha == NULL ? 1.f : alpha[r]);
    for (int c = 0; c < NV; c++) acc[r][c] = _mm512_loadu_ps(o + r * Dh + 16 * c);
    if (alpha != NULL && alpha[r] != 1.f)  // the online softmax's rescale of the output so far
      for (int c = 0; c < NV; c++) acc[r][c] = _mm512_mul_ps(acc[r][c], a);
  }
  for (int64_t t = 0; t < nk; t++) {
    __m512 vv[2];
    for (int c = 0; c < NV; c++) vv[c] = _mm512_loadu_ps(v + t * Dh + 16 * c);
    for (int r = 0; r < RB; r++) {
      const __m512 b = _mm512_set1_ps(p[r * BK + t]);
      for (int c = 0; c < NV; c++) acc[r][c] = _mm512_fmadd_ps(b, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; r++)
    for (int c = 0; c < NV; c++) _mm512_storeu_ps(o + r * Dh + 16 * c, acc[r][c]);
}
#endif

/* S = Q K^T for the item's R rows against the block's keys (all BK columns; padding keys are
   zero rows of kt). */
static inline __attribute__((always_inline)) void scores(const int64_t Dh, int64_t R,
                                                         const buffers *b) {
#if HAVE_AVX512
  if (Dh % 16 == 0) {
    int64_t r = 0;
    for (; r + 6 <= R; r += 6) qk_block(6, Dh, b->q + r * Dh, b->kt, b->s + r * BK);
    const float *q = b->q + r * Dh;
    float *s = b->s + r * BK;
    switch (R - r) {  // the last rows: one block of a constant size
      case 5: qk_block(5, Dh, q, b->kt, s); break;
      case 4: qk_block(4, Dh, q, b->kt, s); break;
      case 3: qk_block(3, Dh, q, b->kt, s); break;
      case 2: qk_block(2, Dh, q, b->kt, s); break;
      case 1: qk_block(1, Dh, q, b->kt, s); break;
    }
    return;
  }
#endif
  for (int64_t r = 0; r < R; r++) {
    float *s = b->s + r * BK;
    for (int64_t t = 0; t < BK; t++) s[t] = 0.f;
    for (int64_t x = 0; x < Dh; x++) {
      const float qx = b->q[r * Dh + x];
      for (int64_t t = 0; t < BK; t++) s[t] += qx * b->kt[x * BK + t];
    }
  }
}

#if HAVE_BF16_DOT
/* s[r][0..BK) = scale * <q_r, keys> for RB rows of bfloat16 pairs (qw [RB, Dh / 2] words,
   ktw [Dh / 2, BK] words: key t's elements 2p, 2p + 1 at ktw[p * BK + t]). */
static inline __attribute__((always_inline)) void qk_block_bf16(const int RB, const int64_t Dh,
                                                                const uint32_t *qw,
                                                                const uint32_t *ktw,
                                                                float scale, float *s) {
  __m512 a[6][4];
  for (int r = 0; r < RB; r++)
    for (int c = 0; c < 4; c++) a[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < Dh / 2; p++) {
    __m512bh k[4];
    for (int c = 0; c < 4; c++)
      k[c] = (__m512bh)_mm512_loadu_si512((const void *)(ktw + p * BK + 16 * c));
    for (int r = 0; r < RB; r++) {
      const __m512bh vq = (__m512bh)_mm512_set1_epi32((int)qw[r * (Dh / 2) + p]);
      for (int c = 0; c < 4; c++) a[r][c] = _mm512_dpbf16_ps(a[r][c], vq, k[c]);
    }
  }
  const __m512 vs = _mm512_set1_ps(scale);
  for (int r = 0; r < RB; r++)
    for (int c = 0; c < 4; c++) _mm512_storeu_ps(s + r * BK + 16 * c, _mm512_mul_ps(a[r][c], vs));
}

static inline __attribute__((always_inline)) void scores_bf16(const int64_t Dh, int64_t R,
                                                              float scale, const buffers *b) {
  const uint32_t *qw = (const uint32_t *)b->q, *ktw = (const uint32_t *)b->kt;
  const int64_t W = Dh / 2;
  int64_t r = 0;
  for (; r + 6 <= R; r += 6) qk_block_bf16(6, Dh, qw + r * W, ktw, scale, b->s + r * BK);
  const uint32_t *q = qw + r * W;
  float *s = b->s + r * BK;
  switch (R - r) {
    case 5: qk_block_bf16(5, Dh, q, ktw, scale, s); break;
    case 4: qk_block_bf16(4, Dh, q, ktw, scale, s); break;
    case 3: qk_block_bf16(3, Dh, q, ktw, scale, s); break;
    case 2: qk_block_bf16(2, Dh, q, ktw, scale, s); break;
    case 1: qk_block_bf16(1, Dh, q, ktw, scale, s); break;
  }
}
#endif

/* O = O * alpha + P V over the block's first nk keys (alpha: each row's rescale factor, or
   NULL: already applied). */
static inline __attribute__((always_inline)) void weighted_values(const int64_t Dh, int64_t R,
                                                                  int64_t nk, const buffers *b,
                                                                  const float *alpha) {
#if HAVE_AVX512
  if (Dh % 16 == 0) {
    for (int64_t c = 0; c < Dh; c += 32) {  // columns 32 at a time (2 vectors), then 16
      const float *v = b->v + c;
      float *o = b->o + c;
      int64_t r = 0;
#define ROWS(RB, NV) \
  pv_block(RB, NV, Dh, b->s + r * BK, v, nk, o + r * Dh, alpha == NULL ? NULL : alpha + r)
      if (Dh - c >= 32) {
        for (; r + 8 <= R; r += 8) ROWS(8, 2);
        for (; r < R; r++) ROWS(1, 2);
      } else {
        for (; r + 8 <= R; r += 8) ROWS(8, 1);
        for (; r < R; r++) ROWS(1, 1);
      }
#undef ROWS
    }
    return;
  }
#endif
  if (alpha != NULL)
    for (int64_t r = 0; r < R; r++)
      for (int64_t x = 0; x < Dh; x++) b->o[r * Dh + x] *= alpha[r];
  for (int64_t r = 0; r < R; r++)
    for (int64_t t = 0; t < nk; t++) {
      const float p = b->s[r * BK + t];
      for (int64_t x = 0; x < Dh; x++) b->o[r * Dh + x] += p * b->v[t * Dh + x];
    }
}

/* Row s[0..BK) -> e^(s - m_new) in place, with m_new = max(m, max s); updates m and l
   (l = l e^(m - m_new) + sum) and returns the factor e^(m - m_new) that the row's output must
   be scaled by. The row's first block always holds a visible key (key 0), so m is finite
   after it; a later block may be all masked (-inf): its probabilities are then 0. */
static inline float softmax_step(float *s, float *m, float *l) {
  float mx = -INFINITY, sum = 0.f;
  int64_t t = 0;
#if HAVE_AVX512
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (; t < BK; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + t));
  mx = _mm512_reduce_max_ps(vm);
#else
  for (; t < BK; t++) mx = s[t] > mx ? s[t] : mx;
#endif
  const float m_new = mx > *m ? mx : *m;
  const float alpha = *m == -INFINITY ? 0.f : expf(*m - m_new);
#if HAVE_AVX512
  const __m512 vmax = _mm512_set1_ps(m_new);
  __m512 vsum = _mm512_setzero_ps();
  for (t = 0; t < BK; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), vmax));
    _mm512_storeu_ps(s + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  sum = _mm512_reduce_add_ps(vsum);
#else
  for (t = 0; t < BK; t++) {
    const float e = s[t] == -INFINITY ? 0.f : expf(s[t] - m_new);
    s[t] = e;
    sum += e;
  }
#endif
  *m = m_new;
  *l = *l * alpha + sum;
  return alpha;
}

#if HAVE_AVX512
/* One block of the online softmax for RB rows, the scores kept in registers: S = Q K^T over
   the block's first NC * 16 keys (float32 q times the scale, or with DOT bfloat16 pairs through
   vdpbf16ps, the scale applied to the sums), the causal mask (with `diag`: row r sees the
   block's keys t < lim[r]), then softmax_step's update of each row's m and l, P = e^(S - m_new)
   into s and the output's rescale factor into alpha. The same operations in the same order as
   scores + mask + softmax_step over all BK keys: keys past NC * 16 are masked for every row,
   and their zero probabilities add nothing to the sums. */
static inline __attribute__((always_inline)) void qk_softmax(
    const int RB, const int NC, const int DOT, const int64_t Dh, const void *q, const void *kt,
    float scale, int diag, const int64_t *lim, float *s, float *m, float *l, float *alpha) {
  __m512 a[6][4];
  for (int r = 0; r < RB; r++)
    for (int c = 0; c < NC; c++) a[r][c] = _mm512_setzero_ps();
#if HAVE_BF16_DOT
  if (DOT) {
    const uint32_t *qw = (const uint32_t *)q, *ktw = (const uint32_t *)kt;
    for (int64_t p = 0; p < Dh / 2; p++) {
      __m512bh k[4];
      for (int c = 0; c < NC; c++)
        k[c] = (__m512bh)_mm512_loadu_si512((const void *)(ktw + p * BK + 16 * c));
      for (int r = 0; r < RB; r++) {
        const __m512bh vq = (__m512bh)_mm512_set1_epi32((int)qw[r * (Dh / 2) + p]);
        for (int c = 0; c < NC; c++) a[r][c] = _mm512_dpbf16_ps(a[r][c], vq, k[c]);
      }
    }
    const __m512 vs = _mm512_set1_ps(scale);
    for (int r = 0; r < RB; r++)
      for (int c = 0; c < NC; c++) a[r][c] = _mm512_mul_ps(a[r][c], vs);
  } else
#endif
  {
    const float *qf = (const float *)q, *ktf = (const float *)kt;
    for (int64_t x = 0; x < Dh; x++) {
      __m512 k[4];
      for (int c = 0; c < NC; c++) k[c] = _mm512_loadu_ps(ktf + x * BK + 16 * c);
      for (int r = 0; r < RB; r++) {
        const __m512 vq = _mm512_set1_ps(qf[r * Dh + x]);
        for (int c = 0; c < NC; c++) a[r][c] = _mm512_fmadd_ps(vq, k[c], a[r][c]);
      }
    }
  }
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  for (int r = 0; r < RB; r++) {
    if (diag)
      for (int c = 0; c < NC; c++) {
        const int64_t seen = lim[r] - 16 * c;  // keys of this vector the row sees
        const __mmask16 keep =
            seen >= 16 ? (__mmask16)0xFFFF : seen <= 0 ? 0 : (__mmask16)((1u << seen) - 1);
        a[r][c] = _mm512_mask_mov_ps(neg_inf, keep, a[r][c]);
      }
    __m512 vm = a[r][0];
    for (int c = 1; c < NC; c++) vm = _mm512_max_ps(vm, a[r][c]);
    const float mx = _mm512_reduce_max_ps(vm), m_old = m[r];
    const float m_new = mx > m_old ? mx : m_old;
    const float al = m_old == -INFINITY ? 0.f : mx > m_old ? expf(m_old - m_new) : 1.f;
    const __m512 vmax = _mm512_set1_ps(m_new);
    __m512 vsum = _mm512_setzero_ps();
    for (int c = 0; c < NC; c++) {
      const __m512 e = exp16(_mm512_sub_ps(a[r][c], vmax));
      _mm512_storeu_ps(s + r * BK + 16 * c, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    m[r] = m_new;
    l[r] = l[r] * al + _mm512_reduce_add_ps(vsum);
    alpha[r] = al;
  }
}

/* qk_softmax over an item's R rows, in panels of 6, for a constant NC. */
static inline __attribute__((always_inline)) void block_softmax_nc(
    const int NC, const int DOT, const int64_t Dh, int64_t R, float scale, int diag,
    const int64_t *lim, const buffers *b, float *alpha) {
  const int64_t W = DOT ? Dh / 2 : Dh;  // 32-bit words of a q row
  const uint32_t *q = (const uint32_t *)b->q;
  int64_t r = 0;
#define PANEL(RB)                                                                             \
  qk_softmax(RB, NC, DOT, Dh, q + r * W, b->kt, scale, diag, lim + r, b->s + r * BK, b->m + r, \
             b->l + r, alpha + r)
  for (; r + 6 <= R; r += 6) PANEL(6);
  switch (R - r) {  // the last rows: one panel of a constant size
    case 5: PANEL(5); break;
    case 4: PANEL(4); break;
    case 3: PANEL(3); break;
    case 2: PANEL(2); break;
    case 1: PANEL(1); break;
  }
#undef PANEL
}

/* block_softmax_nc for the NC = ceil(nk / 16) key vectors that hold the block's nk keys: the
   rest are masked for every row (a diagonal block, the context's last), so not computed. */
static inline __attribute__((always_inline)) void block_softmax(
    const int DOT, const int64_t Dh, int64_t R, int64_t nk, float scale, int diag,
    const int64_t *lim, const buffers *b, float *alpha) {
  switch ((nk + 15) / 16) {
    case 1: block_softmax_nc(1, DOT, Dh, R, scale, diag, lim, b, alpha); break;
    case 2: block_softmax_nc(2, DOT, Dh, R, scale, diag, lim, b, alpha); break;
    case 3: block_softmax_nc(3, DOT, Dh, R, scale, diag, lim, b, alpha); break;
    default: block_softmax_nc(4, DOT, Dh, R, scale, diag, lim, b, alpha); break;
  }
}
#endif

/* The key block [kb, kb + nk) into b->kt (transposed) and b->v, as float32; zero past nk. */
static inline __attribute__((always_inline)) void load_block(const int64_t Dh, const void *k,
                                                             const void *v, int64_t kb,
                                                             int64_t nk, int64_t kv_t, int bf16,
                                                             int dot, const buffers *b) {
  if (dot) {  // K as bfloat16 pairs, transposed by 32-bit words (scores_bf16)
    uint32_t *ktw = (uint32_t *)b->kt;
    for (int64_t t = 0; t < nk; t++) {
      const uint32_t *ks = (const uint32_t *)((const uint16_t *)k + (kb + t) * kv_t);
      const uint16_t *vs = (const uint16_t *)v + (kb + t) * kv_t;
      for (int64_t p = 0; p < Dh / 2; p++) ktw[p * BK + t] = ks[p];
      for (int64_t x = 0; x < Dh; x++) b->v[t * Dh + x] = bf16_load(vs[x]);
    }
    for (int64_t t = nk; t < BK; t++) {
      for (int64_t p = 0; p < Dh / 2; p++) ktw[p * BK + t] = 0;
      for (int64_t x = 0; x < Dh; x++) b->v[t * Dh + x] = 0.f;
    }
    return;
  }
  for (int64_t t = 0; t < nk; t++) {
    if (bf16) {
      const uint16_t *ks = (const uint16_t *)k + (kb + t) * kv_t;
      const uint16_t *vs = (const uint16_t *)v + (kb + t) * kv_t;
      for (int64_t x = 0; x < Dh; x++) b->kt[x * BK + t] = bf16_load(ks[x]);
      for (int64_t x = 0; x < Dh; x++) b->v[t * Dh + x] = bf16_load(vs[x]);
    } else {
      const float *ks = (const float *)k + (kb + t) * kv_t;
      const float *vs = (const float *)v + (kb + t) * kv_t;
      for (int64_t x = 0; x < Dh; x++) b->kt[x * BK + t] = ks[x];
      for (int64_t x = 0; x < Dh; x++) b->v[t * Dh + x] = vs[x];
    }
  }
  for (int64_t t = nk; t < BK; t++) {
    for (int64_t x = 0; x < Dh; x++) b->kt[x * BK + t] = 0.f;
    for (int64_t x = 0; x < Dh; x++) b->v[t * Dh + x] = 0.f;
  }
}

/* One item: chunk c's query tokens [i0, i0 + nq) for KV head h; rows ordered (token, query
   head of the group). */
static inline __attribute__((always_inline)) void item(
    const int64_t Dh, int64_t g, int64_t n, int64_t C, int64_t i0, int64_t nq, int64_t h,
    const void *q, int64_t q_t, const void *k, const void *v, int64_t kv_t, void *out,
    int64_t o_t, float scale, int bf16, const buffers *b) {
  const int64_t R = nq * g, offset = C - n, kend = offset + i0 + nq;  // keys [0, kend) seen
  const size_t esize = bf16 ? 2 : 4;
#if HAVE_BF16_DOT
  const int dot = bf16 && Dh % 16 == 0;
#else
  const int dot = 0;
#endif
  for (int64_t i = 0; i < nq; i++)
    for (int64_t j = 0; j < g; j++) {
      const char *src = (const char *)q + ((i0 + i) * q_t + (h * g + j) * Dh) * esize;
      if (dot) {  // as stored: the products' scale is applied to the scores
        uint16_t *dst = (uint16_t *)b->q + (i * g + j) * Dh;
        for (int64_t x = 0; x < Dh; x++) dst[x] = ((const uint16_t *)src)[x];
        continue;
      }
      float *dst = b->q + (i * g + j) * Dh;
      for (int64_t x = 0; x < Dh; x++) dst[x] = load_at(src, x, bf16) * scale;
    }
  for (int64_t r = 0; r < R; r++) b->m[r] = -INFINITY, b->l[r] = 0.f;
  for (int64_t e = 0; e < R * Dh; e++) b->o[e] = 0.f;
  for (int64_t kb = 0; kb < kend; kb += BK) {
    const int64_t nk = kend - kb < BK ? kend - kb : BK;
    load_block(Dh, k, v, kb, nk, kv_t, bf16, dot, b);
    // causal mask: key kb + t is visible to token i0 + i iff kb + t <= offset + i0 + i
    // (padding keys t >= nk lie past every row's limit)
    const int64_t first_hidden = offset + i0 + 1 - kb;  // the first row's first masked key
#if HAVE_AVX512
    if (Dh % 16 == 0) {  // scores, mask and softmax in registers, a panel of rows at a time
      const int diag = first_hidden < BK;
      if (diag)
        for (int64_t r = 0; r < R; r++) b->lim[r] = first_hidden + r / g;
      if (dot) block_softmax(1, Dh, R, nk, scale, diag, b->lim, b, b->alpha);
      else block_softmax(0, Dh, R, nk, scale, diag, b->lim, b, b->alpha);
      weighted_values(Dh, R, nk, b, b->alpha);
      continue;
    }
#endif
#if HAVE_BF16_DOT
    if (dot) scores_bf16(Dh, R, scale, b);
    else
#endif
      scores(Dh, R, b);
    if (first_hidden < BK)
      for (int64_t i = 0; i < nq; i++) {
        const int64_t from = first_hidden + i < 0 ? 0 : first_hidden + i;
        for (int64_t j = 0; j < g; j++)
          for (int64_t t = from; t < BK; t++) b->s[(i * g + j) * BK + t] = -INFINITY;
      }
    for (int64_t r = 0; r < R; r++) {
      const float alpha = softmax_step(b->s + r * BK, b->m + r, b->l + r);
      if (alpha != 1.f)
        for (int64_t x = 0; x < Dh; x++) b->o[r * Dh + x] *= alpha;
    }
    weighted_values(Dh, R, nk, b, NULL);
  }
  for (int64_t i = 0; i < nq; i++)
    for (int64_t j = 0; j < g; j++) {
      const int64_t r = i * g + j;
      const float inv = 1.f / b->l[r];
      const int64_t at = (i0 + i) * o_t + (h * g + j) * Dh;
      if (bf16)
        for (int64_t x = 0; x < Dh; x++)
          ((uint16_t *)out)[at + x] = bf16_round(b->o[r * Dh + x] * inv);
      else
        for (int64_t x = 0; x < Dh; x++) ((float *)out)[at + x] = b->o[r * Dh + x] * inv;
    }
}

#if HAVE_AMX
/* The bfloat16 path on AMX tiles (head sizes a multiple of 32, up to 128): S = Q K^T and
   O += P V each a tile product (_tile_dpbf16ps: bfloat16 pairs, float32 sums), the mask and
   the online softmax in AVX-512 between them. Every tile is 16 rows x 64 bytes: an A tile 16
   rows x 32 bfloat16, a B tile 16 pairs of rows x 16 columns in the pair ("VNNI") layout, a C
   tile 16 x 16 float32. K's block is already in that layout as transposed pairs (ktw: pair p of
   key t at ktw[p * BK + t]); V's block is laid out as key pairs (vw: keys 2u, 2u + 1 of column
   x at word u * Dh + x), both in the per-thread scratch, not in the KV pool. The probabilities
   P = e^(S - m) are rounded to bfloat16 for the P V product (as torch's bfloat16 SDPA and HF's
   eager bfloat16 attention round them); the row sums l add those rounded values, so each
   output row is the rounded weights' exact-sum-normalised combination of V's rows.

   Where the process may not use the tiles (amx_tiles.h: amx_usable) the AVX-512 path runs.
   Tile numbers are immediates: C tiles 0-3, A 4, B 5. */

/* s[0 .. Rp)[0 .. NC * 16) = <q_r, key t> (unscaled) for the block's first NC * 16 keys. */
static inline __attribute__((always_inline)) void amx_scores(const int64_t Dh, int64_t Rp, int NC,
                                                             const uint16_t *q,
                                                             const uint32_t *ktw, float *s) {
  for (int64_t i = 0; i < Rp; i += 16) {
#define ZERO(j) _tile_zero(j)
    FOR_TILES(NC, ZERO);
    for (int64_t x = 0; x < Dh; x += 32) {
      _tile_loadd(4, q + i * Dh + x, Dh * 2);
#define DOT(j)                                                 \
  do {                                                         \
    _tile_loadd(5, ktw + x / 2 * BK + 16 * (j), BK * 4);       \
    _tile_dpbf16ps(j, 4, 5);                                   \
  } while (0)
      FOR_TILES(NC, DOT);
#undef DOT
    }
#define STORE(j) _tile_stored(j, s + i * BK + 16 * (j), BK * 4)
    FOR_TILES(NC, STORE);
#undef STORE
#undef ZERO
  }
}

/* o[0 .. Rp) += P V over the block's first 32 * KS keys (p bfloat16 rows BK apart, zero past
   the block's keys; vw the key pairs). */
static inline __attribute__((always_inline)) void amx_weighted_values(const int64_t Dh,
                                                                      int64_t Rp, int64_t KS,
                                                                      const uint16_t *p,
                                                                      const uint32_t *vw,
                                                                      float *o) {
  for (int64_t i = 0; i < Rp; i += 16)
    for (int64_t c = 0; c < Dh; c += 64) {  // 4 C tiles (64 columns) at a time
      const int NC = Dh - c >= 64 ? 4 : (int)(Dh - c) / 16;
      float *oc = o + i * Dh + c;
#define LOAD(j) _tile_loadd(j, oc + 16 * (j), Dh * 4)
      FOR_TILES(NC, LOAD);
#undef LOAD
      for (int64_t u = 0; u < KS; u++) {
        _tile_loadd(4, p + i * BK + 32 * u, BK * 2);
        amx_dot_values(NC, vw, u, c, Dh);
      }
      amx_store_c(NC, oc, Dh);
    }
}

/* Row r's scores s[0 .. NC * 16) times the scale, masked past lim[r] keys (with `diag`), into
   bfloat16 probabilities p[0 .. 32 * ceil(NC / 2)) (zero past NC * 16): updates m and l and
   returns the output's rescale factor, as softmax_step does. */
static inline __attribute__((always_inline)) float amx_softmax_row(int NC, float scale,
                                                                   int diag, int64_t lim,
                                                                   const float *s, uint16_t *p,
                                                                   float *m, float *l) {
  __m512 a[4];
  const __m512 vs = _mm512_set1_ps(scale), neg_inf = _mm512_set1_ps(-INFINITY);
  __m512 vm = neg_inf;
  for (int c = 0; c < NC; c++) {
    a[c] = _mm512_mul_ps(_mm512_loadu_ps(s + 16 * c), vs);
    if (diag) {
      const int64_t seen = lim - 16 * c;  // keys of this vector the row sees
      const __mmask16 keep =
          seen >= 16 ? (__mmask16)0xFFFF : seen <= 0 ? 0 : (__mmask16)((1u << seen) - 1);
      a[c] = _mm512_mask_mov_ps(neg_inf, keep, a[c]);
    }
    vm = _mm512_max_ps(vm, a[c]);
  }
  const float mx = _mm512_reduce_max_ps(vm), m_old = *m;
  const float m_new = mx > m_old ? mx : m_old;
  const float al = m_old == -INFINITY ? 0.f : mx > m_old ? expf(m_old - m_new) : 1.f;
  const __m512 vmax = _mm512_set1_ps(m_new);
  __m512 vsum = _mm512_setzero_ps();
  for (int c = 0; c < NC; c++) {
    const __m256bh e = _mm512_cvtneps_pbh(exp16(_mm512_sub_ps(a[c], vmax)));  // to nearest even
    _mm256_storeu_si256((__m256i *)(p + 16 * c), (__m256i)e);
    vsum = _mm512_add_ps(vsum, _mm512_cvtpbh_ps(e));  // the rounded values
  }
  if (NC & 1) _mm256_storeu_si256((__m256i *)(p + 16 * NC), _mm256_setzero_si256());
  *m = m_new;
  *l = *l * al + _mm512_reduce_add_ps(vsum);
  return al;
}

/* V's block [kb, kb + nk) as key pairs into vw (zero past nk, up to BK). */
static inline __attribute__((always_inline)) void amx_load_values(const int64_t Dh,
                                                                  const uint16_t *v, int64_t kb,
                                                                  int64_t nk, int64_t kv_t,
                                                                  uint32_t *vw) {
  for (int64_t t = 0; t < nk; t += 2) {
    const uint16_t *v0 = v + (kb + t) * kv_t;
    if (t + 1 < nk) {
      const uint16_t *v1 = v0 + kv_t;
      for (int64_t x = 0; x < Dh; x += 16) {  // interleave two rows' 16 elements
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v0 + x)));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v1 + x)));
        _mm512_storeu_si512((void *)(vw + t / 2 * Dh + x),
                            _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    } else
      for (int64_t x = 0; x < Dh; x++) vw[t / 2 * Dh + x] = v0[x];
  }
  for (int64_t u = (nk + 1) / 2; u < BK / 2; u++)
    for (int64_t x = 0; x < Dh; x++) vw[u * Dh + x] = 0;
}

/* item() on AMX: same arguments, bfloat16 only, Dh % 32 == 0, Dh <= 128. */
static inline __attribute__((always_inline)) void item_amx(
    const int64_t Dh, int64_t g, int64_t n, int64_t C, int64_t i0, int64_t nq, int64_t h,
    const uint16_t *q, int64_t q_t, const uint16_t *k, const uint16_t *v, int64_t kv_t,
    uint16_t *out, int64_t o_t, float scale, const buffers *b) {
  const int64_t R = nq * g, Rp = (R + 15) / 16 * 16, offset = C - n, kend = offset + i0 + nq;
  uint16_t *qb = (uint16_t *)b->q, *p = b->p;
  uint32_t *ktw = (uint32_t *)b->kt, *vw = (uint32_t *)b->v;
  for (int64_t i = 0; i < nq; i++)
    for (int64_t j = 0; j < g; j++)
      memcpy(qb + (i * g + j) * Dh, q + (i0 + i) * q_t + (h * g + j) * Dh, Dh * 2);
  memset(qb + R * Dh, 0, (size_t)((Rp - R) * Dh) * 2);  // padding rows: zero scores
  memset(p + R * BK, 0, (size_t)((Rp - R) * BK) * 2);   // and zero probabilities
  for (int64_t r = 0; r < R; r++) b->m[r] = -INFINITY, b->l[r] = 0.f;
  memset(b->o, 0, sizeof(float) * (size_t)(Rp * Dh));
  for (int64_t kb = 0; kb < kend; kb += BK) {
    const int64_t nk = kend - kb < BK ? kend - kb : BK;
    const int NC = (int)((nk + 15) / 16);  // key vectors holding the block's keys
    for (int64_t t = 0; t < nk; t++) {
      const uint32_t *ks = (const uint32_t *)(k + (kb + t) * kv_t);
      for (int64_t u = 0; u < Dh / 2; u++) ktw[u * BK + t] = ks[u];
    }
    amx_load_values(Dh, v, kb, nk, kv_t, vw);
    amx_scores(Dh, Rp, NC, qb, ktw, b->s);  // keys past nk: garbage columns, masked below
    const int64_t first_hidden = offset + i0 + 1 - kb;  // as in item()
    const int diag = first_hidden < BK;
    for (int64_t r = 0; r < R; r++) {
      const float al = amx_softmax_row(NC, scale, diag, first_hidden + r / g, b->s + r * BK,
                                       p + r * BK, b->m + r, b->l + r);
      if (al != 1.f) {
        const __m512 va = _mm512_set1_ps(al);
        for (int64_t x = 0; x < Dh; x += 16)
          _mm512_storeu_ps(b->o + r * Dh + x, _mm512_mul_ps(_mm512_loadu_ps(b->o + r * Dh + x), va));
      }
    }
    amx_weighted_values(Dh, Rp, (nk + 31) / 32, p, vw, b->o);
  }
  for (int64_t i = 0; i < nq; i++)
    for (int64_t j = 0; j < g; j++) {
      const int64_t r = i * g + j;
      const __m512 inv = _mm512_set1_ps(1.f / b->l[r]);
      uint16_t *dst = out + (i0 + i) * o_t + (h * g + j) * Dh;
      for (int64_t x = 0; x < Dh; x += 16)
        bf16_store16(dst + x, _mm512_mul_ps(_mm512_loadu_ps(b->o + r * Dh + x), inv));
    }
}
#endif

/* Whether bfloat16 items run on AMX tiles here (built with them, and the CPU and OS allow). */
int prefill_attention_has_amx(void) {
#if HAVE_AMX
  return amx_usable();
#else
  return 0;
#endif
}

/* q: chunk c's query token i, head a at q + c * q_c + i * q_t + a * Dh (elements); K, V: chunk
   c's key j of KV head h at k + c * kv_c + h * kv_h + j * kv_t; out like q with o_c, o_t.
   Elements are float32 (bf16 == 0) or bfloat16 (bf16 == 1), rows of Dh contiguous elements.
   Returns 0, or -1 if a buffer could not be allocated (out is then incomplete). */
int prefill_attention(int64_t count, int64_t n, int64_t C, int64_t H, int64_t Hkv, int64_t Dh,
                      const void *q, int64_t q_c, int64_t q_t, const void *k, const void *v,
                      int64_t kv_c, int64_t kv_h, int64_t kv_t, void *out, int64_t o_c,
                      int64_t o_t, float scale, int bf16, int num_threads) {
  // about 128 rows an item (at least 16 tokens): each K / V block converted serves them all
  const int64_t g = H / Hkv, BQ = 128 / g > 16 ? 128 / g : 16;
  const int64_t blocks = (n + BQ - 1) / BQ, rows = (BQ * g + 15) / 16 * 16;  // whole tiles
  const size_t esize = bf16 ? 2 : 4;
  const int amx = bf16 && Dh % 32 == 0 && Dh <= 128 && prefill_attention_has_amx();
  int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
  {
    buffers b = {0};
    float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * rows * Dh + 2 * Dh * BK +
                                                          rows * BK + 3 * rows) +
                                 sizeof(int64_t) * (size_t)rows +
                                 sizeof(uint16_t) * (size_t)(rows * BK));
    failed = buf == NULL;
    if (buf != NULL) {
      b.q = buf, b.kt = b.q + rows * Dh, b.v = b.kt + Dh * BK, b.s = b.v + BK * Dh;
      b.o = b.s + rows * BK, b.m = b.o + rows * Dh, b.l = b.m + rows, b.alpha = b.l + rows;
      b.lim = (int64_t *)(b.alpha + rows), b.p = (uint16_t *)(b.lim + rows);
    }
#if HAVE_AMX
    if (amx) amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < blocks * count * Hkv; it++) {
      if (buf == NULL) continue;
      const int64_t blk = blocks - 1 - it / (count * Hkv);  // heaviest (last) blocks first
      const int64_t c = it % (count * Hkv) / Hkv, h = it % Hkv;
      const int64_t i0 = blk * BQ, nq = n - i0 < BQ ? n - i0 : BQ;
      const char *qc = (const char *)q + c * q_c * esize;
      const char *kc = (const char *)k + (c * kv_c + h * kv_h) * esize;
      const char *vc = (const char *)v + (c * kv_c + h * kv_h) * esize;
      char *oc = (char *)out + c * o_c * esize;
#if HAVE_AMX
      if (amx) {
#define ITEM(DH)                                                                            \
  item_amx(DH, g, n, C, i0, nq, h, (const uint16_t *)qc, q_t, (const uint16_t *)kc,          \
           (const uint16_t *)vc, kv_t, (uint16_t *)oc, o_t, scale, &b)
        switch (Dh) {
          case 32: ITEM(32); break;
          case 64: ITEM(64); break;
          case 128: ITEM(128); break;
          default: ITEM(Dh);
        }
#undef ITEM
        continue;
      }
#endif
      switch (Dh) {  // constant head sizes let the compiler unroll the micro-kernels
#define ITEM(DH) item(DH, g, n, C, i0, nq, h, qc, q_t, kc, vc, kv_t, oc, o_t, scale, bf16, &b)
        case 32: ITEM(32); break;
        case 64: ITEM(64); break;
        case 128: ITEM(128); break;
        default: ITEM(Dh);
#undef ITEM
      }
    }
#if HAVE_AMX
    if (amx) _tile_release();
#endif
    free(buf);
  }
  return failed ? -1 : 0;
}
