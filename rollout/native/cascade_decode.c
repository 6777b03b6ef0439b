/* Cascade decode attention on the CPU, float32 arithmetic over float32 or bfloat16 K / V: the
   function of rollout.attention.cascade_decode_attention_matmul (its reference, and the
   test's).

   Each of the R query rows of sequence d that read KV head h (query token x query head of the
   KV group) attends over [group prefix of d ++ own suffix of d] with one exact softmax. K and V
   are read in place (the suffix may be a strided view of the suffix lanes: any sequence and
   head strides, rows of Dh contiguous floats). Work items are split over OpenMP threads; with
   torch imported first the process's one libgomp (torch's) runs them.

   Without a prefix (Lp = 0) a work item is (sequence d, KV head h): `item`, its scores in a
   per-thread buffer [R, Ls]. With one, a work item is (a run of members of one group, KV head
   h): `group_item` scores all the run's rows against the prefix K together (register-blocked,
   the prefix K transposed once per item) and multiplies their probabilities with the prefix V
   together, several rows per V load; each member's suffix is scored and multiplied on its own.
   A group's members are found from group_of (any order in the batch); a large group is cut
   into several runs so that all threads get work. How rows are blocked never changes a row's
   result: every dot product and every output element is one chain of operations in key / dim
   order, so results are bitwise the same for any number of threads.

   Masking is additive, as in the reference: bias 0 = visible, -inf = not. A masked key's score
   is -inf and its probability exactly 0 whatever its (stale) K row holds; the V row of a key
   masked for every row of an item is never read, so stale padding values never matter (a key
   masked for some rows only is a real token: its V is finite, times 0 for those rows). Every
   row sees at least its own token, so its maximum score is finite.

   With AVX2 + FMA (x86-64, -march=native on a machine that has them) the products are vector
   code and exp is a vector polynomial (Cephes' expf, ~1 ulp); elsewhere plain C loops compute
   the same function. With AVX-512 BF16 (and no AMX: see HAVE_BF16_DOT), bfloat16 K and a q of
   bfloat16 values (a bfloat16 model's), the prefix scores are bfloat16 dot products: the same
   exact products, summed in another order. Results differ from torch's in float32 rounding only.

   Built with AMX-BF16 (-march=native on a CPU that has it) and run where the OS grants the
   tiles, a bfloat16 model's groups of at least AMX_MIN_ROWS query rows a KV head with a prefix
   of AMX_MIN_PREFIX keys or more (head sizes 32, 64, 96 or 128) compute the prefix part on
   tiles instead: S = Q K^T and O = P V as tile products, the softmax in float32 between them,
   P rounded to bfloat16 for the product (as prefill_attention.c's item_amx and torch's
   bfloat16 attention round it); the suffix part stays as above. The path is chosen per group
   (its size and the call's prefix, not the run's size), so it does not depend on the number
   of threads. */

#define _GNU_SOURCE  // syscall (arch_prctl for AMX, amx_tiles.h) under -std=c11
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

#if HAVE_AVX512 && defined(__AVX512BF16__)
#define HAVE_BF16_DOT 1  // the build has vdpbf16ps (amx_tiles.h asks for it besides AMX)
#else
#define HAVE_BF16_DOT 0
#endif

#include "amx_tiles.h"  // HAVE_AMX, amx_usable, amx_configure, FOR_TILES

/* vdpbf16ps (two bfloat16 products a float32 lane, products exact) for a bfloat16 model's prefix
   scores, rather than FMAs over the widened K, only on cores where it is the faster of the two.
   Where it was measured to pay (AMD EPYC: one 512-bit FMA a cycle) it does twice the products
   of an FMA; on the Sapphire-Rapids-class Xeon (two 512-bit FMA ports) it sustains ~0.7 a TSC
   cycle against ~2.8 FMAs (benchmarks/vector_peak.py), so the FMA tile outruns it there. AMX
   (which only those Xeons have) marks the second kind of core; there, large enough groups take
   the tiles instead (AMX_MIN_ROWS). */
#define USE_BF16_DOT (HAVE_BF16_DOT && !HAVE_AMX)

/* Groups of at least AMX_MIN_ROWS query rows a KV head (members x query rows each), in a call
   whose prefix (the longest group's, keys) is at least AMX_MIN_PREFIX, take the AMX prefix
   path; the others the FMA tile. A tile product computes 16 rows however few are real, and
   with short prefixes the tiles' fixed costs (packing K and V, storing and reloading the score
   tiles) outweighed the products they save: against the FMA tile, 16 groups x 8 members, one
   thread, warm, 0.89x at 128 prefix keys, 1.04x at 256, 1.19x at 512 (benchmarks/RESULTS.md). */
enum { AMX_MIN_ROWS = 16, AMX_MIN_PREFIX = 256 };

int cascade_decode_has_avx2(void) { return HAVE_AVX2; }
int cascade_decode_has_bf16_dot(void) { return USE_BF16_DOT; }

/* Whether a bfloat16 model's groups take the AMX prefix path here (built with the tiles, and the
   CPU and OS allow them). */
int cascade_decode_has_amx(void) {
#if HAVE_AMX
  return amx_usable();
#else
  return 0;
#endif
}

/* K / V elements are float32 (bf16 == 0) or bfloat16 (bf16 == 1, widened exactly on load);
   queries, scores, probabilities and outputs are float32 either way. `bf16` is a constant at
   every call site below the entry point, so each function is compiled once per element type. */
static inline __attribute__((always_inline)) const void *kv_at(const void *base, int64_t elems,
                                                              const int bf16) {
  return (const char *)base + elems * (bf16 ? 2 : 4);
}

static inline __attribute__((always_inline)) float kv_get(const void *p, int64_t i,
                                                         const int bf16) {
  return bf16 ? bf16_load(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#if HAVE_AVX2
static inline __attribute__((always_inline)) __m256 kv_load8(const void *p, int64_t i,
                                                            const int bf16) {
  return bf16 ? bf16_load8((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}
#endif

#if HAVE_AVX512
/* The four dots of one row against four keys, as 16-lane partial sums a[0..3] (lane l: the
   products of dims l, l + 16, ...), summed across lanes by one fixed tree (pairs of lanes
   within each 128-bit quarter, then the quarters): lane i of the result is key i's dot. */
static inline __attribute__((always_inline)) __m128 reduce4x16(const __m512 *a) {
  const __m512 u01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 u23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(u01, u23, 0x44), _mm512_shuffle_ps(u01, u23, 0xEE));
  const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(z), _mm512_extractf32x8_ps(z, 1));
  return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}

/* Dots of RB (<= 4) rows of q [RB, Dh] against 16 keys k [16, Dh] as stored (rows of Dh):
   d[r * 16 + t] = <q_r, k_t>. Four keys at a time, a register tile of RB x 4 accumulators along
   Dh (each x loads 4 key vectors and RB q vectors for 4 RB FMAs; the AVX2 loop re-read every
   key for every row), then reduce4x16. A dot's order of operations depends on Dh only, not on
   RB nor on the other rows or keys. Dh a multiple of 16. */
static inline __attribute__((always_inline)) void suffix_dots16(const int RB, const int64_t Dh,
                                                                const float *q, const void *k,
                                                                float *d, const int bf16) {
  for (int g = 0; g < 4; g++) {
    __m512 a[4][4];
    for (int r = 0; r < RB; r++)
      for (int c = 0; c < 4; c++) a[r][c] = _mm512_setzero_ps();
    for (int64_t x = 0; x < Dh; x += 16) {
      __m512 kv[4];
      for (int c = 0; c < 4; c++) {
        const int64_t e = (4 * g + c) * Dh + x;
        kv[c] = bf16 ? bf16_load16((const uint16_t *)k + e) : _mm512_loadu_ps((const float *)k + e);
      }
      for (int r = 0; r < RB; r++) {
        const __m512 vq = _mm512_loadu_ps(q + r * Dh + x);
        for (int c = 0; c < 4; c++) a[r][c] = _mm512_fmadd_ps(vq, kv[c], a[r][c]);
      }
    }
    for (int r = 0; r < RB; r++) _mm_storeu_ps(d + r * 16 + 4 * g, reduce4x16(a[r]));
  }
}
#endif

/* s[r * ld + j] = scale * <q_r, k_j> + bias[(r / rows_per_bias) * bias_stride + j] for the R
   rows of q [R, Dh] against L keys k [L, Dh]; a masked key's score is -inf. With AVX-512 and
   Dh a multiple of 16, keys in blocks of 16 through suffix_dots16 (then 8 at a time as with
   AVX2, then one at a time): which path a key takes depends on L and Dh only. */
static inline __attribute__((always_inline)) void scores(
    const float *q, int64_t R, const int64_t Dh, const void *k, int64_t L, const float *bias,
    int64_t bias_stride, int64_t rows_per_bias, float scale, float *s, int64_t ld,
    const int bf16) {
  int64_t j = 0;
#if HAVE_AVX512
  if (Dh % 16 == 0) {
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    float d[4 * 16];
    for (; j + 16 <= L; j += 16) {
      const void *kb = kv_at(k, j * Dh, bf16);
      for (int64_t r0 = 0; r0 < R; r0 += 4) {
        const int rb = R - r0 < 4 ? (int)(R - r0) : 4;
        __mmask16 m[4];
        int any = 0;
        for (int r = 0; r < rb; r++) {
          const __m512 vb = _mm512_loadu_ps(bias + ((r0 + r) / rows_per_bias) * bias_stride + j);
          m[r] = _mm512_cmp_ps_mask(vb, ninf, _CMP_EQ_OQ);
          any |= m[r] != 0xFFFF;
        }
        if (any) switch (rb) {  // else a whole masked block: no dots
            case 4: suffix_dots16(4, Dh, q + r0 * Dh, kb, d, bf16); break;
            case 3: suffix_dots16(3, Dh, q + r0 * Dh, kb, d, bf16); break;
            case 2: suffix_dots16(2, Dh, q + r0 * Dh, kb, d, bf16); break;
            case 1: suffix_dots16(1, Dh, q + r0 * Dh, kb, d, bf16); break;
          }
        for (int r = 0; r < rb; r++) {
          float *sr = s + (r0 + r) * ld + j;
          if (m[r] == 0xFFFF) {
            _mm512_storeu_ps(sr, ninf);
            continue;
          }
          const __m512 vb = _mm512_loadu_ps(bias + ((r0 + r) / rows_per_bias) * bias_stride + j);
          // a masked key: -inf whatever its (stale) K row holds (inf + -inf would be NaN)
          _mm512_storeu_ps(sr, _mm512_mask_blend_ps(
                                   m[r], _mm512_fmadd_ps(_mm512_loadu_ps(d + r * 16), vscale, vb),
                                   ninf));
        }
      }
    }
  }
#endif
#if HAVE_AVX2
  const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
  for (; Dh % 8 == 0 && j + 8 <= L; j += 8) {  // other head sizes: the plain loop below
    const void *kb = kv_at(k, j * Dh, bf16);
    for (int64_t r = 0; r < R; r++) {
      __m256 vb = _mm256_loadu_ps(bias + (r / rows_per_bias) * bias_stride + j);
      const __m256 masked = _mm256_cmp_ps(vb, ninf, _CMP_EQ_OQ);
      if (_mm256_movemask_ps(masked) == 0xff) {
        _mm256_storeu_ps(s + r * ld + j, ninf);  // a whole masked block: no dots
        continue;
      }
      const float *qr = q + r * Dh;
      __m256 a[8];
      for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
      for (int64_t x = 0; x + 8 <= Dh; x += 8) {
        __m256 vq = _mm256_loadu_ps(qr + x);
        for (int i = 0; i < 8; i++)
          a[i] = _mm256_fmadd_ps(vq, kv_load8(kb, i * Dh + x, bf16), a[i]);
      }
      // horizontal sums of the 8 accumulators: lane i = <q_r, k_{j+i}>
      __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
      __m256 dot = _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                                 _mm256_permute2f128_ps(t0, t1, 0x31));
      // a masked key: -inf whatever its (stale) K row holds (inf + -inf would be NaN)
      _mm256_storeu_ps(s + r * ld + j,
                       _mm256_blendv_ps(_mm256_fmadd_ps(dot, vscale, vb), ninf, masked));
    }
  }
#endif
  for (; j < L; j++) {
    const void *kj = kv_at(k, j * Dh, bf16);
    for (int64_t r = 0; r < R; r++) {
      float b = bias[(r / rows_per_bias) * bias_stride + j];
      if (b == -INFINITY) {
        s[r * ld + j] = -INFINITY;
        continue;
      }
      float acc = 0.f;
      for (int64_t x = 0; x < Dh; x++) acc += q[r * Dh + x] * kv_get(kj, x, bf16);
      s[r * ld + j] = acc * scale + b;
    }
  }
}


/* Largest of s[0..L) (-inf if L == 0). */
static inline float row_max(const float *s, int64_t L) {
  float m = -INFINITY;
  int64_t j = 0;
#if HAVE_AVX512
  if (L >= 16) {
    __m512 vm16 = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= L; j += 16) vm16 = _mm512_max_ps(vm16, _mm512_loadu_ps(s + j));
    m = _mm512_reduce_max_ps(vm16);
  }
#endif
#if HAVE_AVX2
  float lane[8];
  __m256 vm = _mm256_set1_ps(-INFINITY);
  for (; j + 8 <= L; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + j));
  _mm256_storeu_ps(lane, vm);
  for (int i = 0; i < 8; i++) m = lane[i] > m ? lane[i] : m;
#endif
  for (; j < L; j++) m = s[j] > m ? s[j] : m;
  return m;
}

#if HAVE_AVX512
/* exp16 of x <= 0 (a score minus its row's maximum; -inf for a masked key): the same result
   bit for bit without exp16's clamps, which change no such x (below -87.3 the result is 0
   through the underflow mask either way). */
static inline __m512 exp16_nonpositive(__m512 x) {
  return exp16_in_range(x, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_LT_OQ));
}
#endif

/* s[0..L) -> e^(s - m) in place (m: the largest score, so every s - m <= 0); returns their
   sum. */
static inline float exp_sum(float *s, int64_t L, float m) {
  float sum = 0.f;
  int64_t j = 0;
#if HAVE_AVX512
  if (L >= 16) {  // exp8's function lane for lane: each e^(s - m) is the same float either way
    const __m512 vmax16 = _mm512_set1_ps(m);
    __m512 vsum16 = _mm512_setzero_ps();
    for (; j + 16 <= L; j += 16) {
      const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), vmax16));
      _mm512_storeu_ps(s + j, e);
      vsum16 = _mm512_add_ps(vsum16, e);
    }
    sum = _mm512_reduce_add_ps(vsum16);
  }
#endif
#if HAVE_AVX2
  float lane[8];
  __m256 vmax = _mm256_set1_ps(m), vsum = _mm256_setzero_ps();
  for (; j + 8 <= L; j += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmax));
    _mm256_storeu_ps(s + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  _mm256_storeu_ps(lane, vsum);
  for (int i = 0; i < 8; i++) sum += lane[i];
#endif
  for (; j < L; j++) {
    float e = s[j] == -INFINITY ? 0.f : expf(s[j] - m);
    s[j] = e;
    sum += e;
  }
  return sum;
}

/* Row r of s (L scores) -> unnormalised probabilities e^(s - max) in place; returns their sum. */
static inline float exp_row(float *sr, int64_t L) { return exp_sum(sr, L, row_max(sr, L)); }

#if HAVE_AVX512
/* row_max and exp_sum of one row of L = 16 * blocks scores stored as blocks of 16 floats,
   block c at s + c * ldc (the prefix scores by key blocks; keys past the prefix -inf, so they
   add exact zeros). exp_sum_blocked's sum is one 16-lane chain over the blocks in order. */
static inline float row_max_blocked(const float *s, int64_t ldc, int64_t L) {
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (int64_t c = 0; c < L / 16; c++) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + c * ldc));
  return _mm512_reduce_max_ps(vm);
}

static inline float exp_sum_blocked(float *s, int64_t ldc, int64_t L, float m) {
  const __m512 vmax = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t c = 0; c < L / 16; c++) {
    const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + c * ldc), vmax));
    _mm512_storeu_ps(s + c * ldc, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  return _mm512_reduce_add_ps(vsum);
}
#endif

#if HAVE_AVX2
/* acc0 += p0[t] V[t], acc1 += p1[t] V[t] over n rows of V [n, Dh]: two query rows share each V
   load, and their 2 x Dh / 8 independent accumulator chains hide the FMA latency. */
static inline __attribute__((always_inline)) void pv_pair(const int64_t Dh, const float *p0,
                                                          const float *p1, const void *V,
                                                          int64_t n, __m256 *acc0, __m256 *acc1,
                                                          const int bf16) {
  for (int64_t t = 0; t < n; t++) {
    if (p0[t] == 0.f && p1[t] == 0.f) continue;  // masked for both: V[t] is never read
    const __m256 b0 = _mm256_set1_ps(p0[t]), b1 = _mm256_set1_ps(p1[t]);
    for (int64_t x = 0; x < Dh / 8; x++) {
      const __m256 v = kv_load8(V, t * Dh + x * 8, bf16);
      acc0[x] = _mm256_fmadd_ps(b0, v, acc0[x]);
      acc1[x] = _mm256_fmadd_ps(b1, v, acc1[x]);
    }
  }
}
#endif

/* One item: out [R, Dh] = softmax([prefix ++ suffix] scores) @ [prefix V ++ suffix V] (called
   with Lp = 0: sequences with a prefix go through `group_item`).
   s holds R * (Lp + Ls) scores, then R normalisers. */
static inline __attribute__((always_inline)) void item(
    const int64_t Dh, int64_t R, int64_t rows_per_bias, const float *q, const void *pk,
    const void *pv, int64_t Lp, const float *pbias, const void *sk, const void *sv, int64_t Ls,
    const float *sbias, float scale, float *out, float *s, const int bf16) {
  const int64_t L = Lp + Ls;
  float *inv = s + R * L;
  if (Lp > 0) scores(q, R, Dh, pk, Lp, pbias, 0, R, scale, s, L, bf16);
  scores(q, R, Dh, sk, Ls, sbias, Ls, rows_per_bias, scale, s + Lp, L, bf16);
  for (int64_t r = 0; r < R; r++) inv[r] = 1.f / exp_row(s + r * L, L);
  int64_t r = 0;
#if HAVE_AVX2
  if (Dh % 8 == 0 && Dh <= 128) {
    for (; r + 2 <= R; r += 2) {  // rows in pairs (a last odd row: the loop below)
      const float *s0 = s + r * L, *s1 = s0 + L;
      __m256 acc0[16], acc1[16];
      for (int64_t x = 0; x < Dh / 8; x++) acc0[x] = acc1[x] = _mm256_setzero_ps();
      pv_pair(Dh, s0, s1, pv, Lp, acc0, acc1, bf16);
      pv_pair(Dh, s0 + Lp, s1 + Lp, sv, Ls, acc0, acc1, bf16);
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
      const void *vt = t < Lp ? kv_at(pv, t * Dh, bf16) : kv_at(sv, (t - Lp) * Dh, bf16);
      for (int64_t x = 0; x < Dh; x++) o[x] += sr[t] * kv_get(vt, x, bf16);
    }
    for (int64_t x = 0; x < Dh; x++) o[x] *= inv[r];
  }
}

/* ---- Group items: the prefix part shared by all the rows of a group's members. ---- */

/* Per-thread buffers of a group item of at most `rows` query rows. */
typedef struct {
  float *q;      // [rows, Dh] the item's query rows, member after member
  uint32_t *qp;  // [rows, Dh / 2] the same rows as bfloat16 pairs (the bfloat16 dot path)
  float *kt;     // [Lpad / 16, Dh, 16] prefix K transposed block by block, keys Lp..Lpad zero
                 // (AVX2 build); on the bfloat16 dot path [Dh / 2, Lpad] pairs of bfloat16
                 // (32-bit words)
  float *pb;     // [Lpad] prefix bias, -inf past Lp
  float *sp;     // prefix scores, then probabilities: [rows, lsp], or by key blocks (see
                 // group_item); room for (rows + 1) * lsp floats
  int64_t lsp;   // sp's row stride, Lpad + 16: rows Lpad * 4 bytes apart (2 KiB at Lpad = 512)
                 // would all fall into the same 2 of L1's 64 sets
  float *ss;     // [rows, Ls] suffix scores, then probabilities
  float *o;      // [rows, Dh] unnormalised outputs
  float *inv;    // [rows] normalisers
  unsigned char *vis;  // [Lpad + Ls] key visible to some row: prefix keys, then one member's suffix
  unsigned char *vis32;  // [Lp32 / 32] some key of a 32-key prefix block visible (AMX path)
  uint16_t *pw;  // [Lp32 / 32, Npad, 32] bfloat16 prefix probabilities as A tiles (AMX path)
  uint32_t *vw;  // [Lp32 / 2, Dh] prefix V by key pairs as B tiles (AMX path)
} group_buffers;

/* Software prefetch of a list of byte ranges, a few cache lines at a time: a group item issues
   the loads of its members' suffix K and V (and of the next item's prefix K) while it computes
   on the prefix, so that their memory latency overlaps arithmetic (each suffix is a short run
   of its own, which the hardware prefetchers learn too late). Only a hint: it changes no
   result. The lines go to L2, not L1 (locality 1): an item's suffix K alone is 128 KiB at
   8 members x 128 keys x Dh 32, so fetched into L1 (48 KiB) they evicted the tiles' K^T, the
   scores and each other before use. */
#define PF_MAX_RANGES 67  // a run of at most 64 members: their suffix K, prefix K, V, next K
typedef struct {
  const char *p[PF_MAX_RANGES];
  int64_t len[PF_MAX_RANGES];
  int k, n;
  int64_t off;
} prefetcher;

static inline void pf_add(prefetcher *f, const void *p, int64_t bytes) {
  if (f->n < PF_MAX_RANGES && p != NULL && bytes > 0)
    f->p[f->n] = (const char *)p, f->len[f->n++] = bytes;
}

static inline int64_t pf_lines(const prefetcher *f) {
  int64_t lines = 0;
  for (int i = f->k; i < f->n; i++) lines += (f->len[i] + 63) / 64;
  return lines - f->off / 64;
}

/* The position is kept in locals while issuing (in *f the compiler would load and store it
   around every prefetch, a dependency chain through memory longer than the prefetch). */
static inline void pf_issue(prefetcher *f, int64_t lines) {
  int k = f->k;
  int64_t off = f->off;
  while (lines > 0 && k < f->n) {
    const char *p = f->p[k];
    const int64_t len = f->len[k];
    for (; lines > 0 && off < len; lines--, off += 64) __builtin_prefetch(p + off, 0, 1);
    if (off >= len) k++, off = 0;
  }
  f->k = k, f->off = off;
}

#if HAVE_AVX2
/* 8 x 8 transpose: dst[x * ldd + j] = src[j * lds + x] for j, x < 8 (as float32). */
static inline __attribute__((always_inline)) void transpose8(const void *src, int64_t lds,
                                                             float *dst, int64_t ldd,
                                                             const int bf16) {
  __m256 r0 = kv_load8(src, 0, bf16), r1 = kv_load8(src, lds, bf16);
  __m256 r2 = kv_load8(src, 2 * lds, bf16), r3 = kv_load8(src, 3 * lds, bf16);
  __m256 r4 = kv_load8(src, 4 * lds, bf16), r5 = kv_load8(src, 5 * lds, bf16);
  __m256 r6 = kv_load8(src, 6 * lds, bf16), r7 = kv_load8(src, 7 * lds, bf16);
  __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(dst, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(dst + ldd, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(dst + 2 * ldd, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(dst + 3 * ldd, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(dst + 4 * ldd, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(dst + 5 * ldd, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(dst + 6 * ldd, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(dst + 7 * ldd, _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* Scores of RB rows of q [RB, Dh] against the 16 keys of kt (columns of [Dh, ldk]): each dot is
   one FMA chain over x = 0..Dh-1 from 0, so a score's rounding does not depend on RB (how rows
   are blocked: the number of threads) nor on which rows share the block. */
static inline __attribute__((always_inline)) void prefix_block(
    const int RB, const int64_t Dh, const float *q, const float *kt, int64_t ldk,
    const float *bias, float scale, float *s, int64_t lds) {
  __m256 a0[6], a1[6];
  for (int r = 0; r < RB; r++) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t x = 0; x < Dh; x++) {
    __m256 k0 = _mm256_loadu_ps(kt + x * ldk), k1 = _mm256_loadu_ps(kt + x * ldk + 8);
    __asm__("" : "+x"(k0), "+x"(k1));  // one load each, kept in registers for the RB rows
    for (int r = 0; r < RB; r++) {
      const __m256 vq = _mm256_broadcast_ss(q + r * Dh + x);
      a0[r] = _mm256_fmadd_ps(vq, k0, a0[r]);
      a1[r] = _mm256_fmadd_ps(vq, k1, a1[r]);
    }
  }
  const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
  const __m256 b0 = _mm256_loadu_ps(bias), b1 = _mm256_loadu_ps(bias + 8);
  const __m256 m0 = _mm256_cmp_ps(b0, ninf, _CMP_EQ_OQ), m1 = _mm256_cmp_ps(b1, ninf, _CMP_EQ_OQ);
  for (int r = 0; r < RB; r++) {  // a masked key: -inf whatever its (stale) K row holds
    _mm256_storeu_ps(s + r * lds, _mm256_blendv_ps(_mm256_fmadd_ps(a0[r], vscale, b0), ninf, m0));
    _mm256_storeu_ps(s + r * lds + 8,
                     _mm256_blendv_ps(_mm256_fmadd_ps(a1[r], vscale, b1), ninf, m1));
  }
}

#if HAVE_AVX512
/* Scores of RB rows of q [RB, Dh] against KB blocks of 16 keys, K^T block-major (block c: the
   [Dh, 16] floats at kt + c * Dh * 16), bias and s per key as in prefix_block. A register tile
   of RB x KB accumulators: each x loads KB key vectors and RB q values for RB * KB FMAs (with
   one key vector a row, 1 + RB loads fed RB FMAs, and loads, not FMAs, set the pace). Each dot
   is still the one FMA chain over x from 0 of prefix_block, so the scores are bitwise its and
   do not depend on RB or KB (how rows and keys are blocked). */
static inline __attribute__((always_inline)) void prefix_tile16(
    const int RB, const int KB, const int64_t Dh, const float *q, const float *kt,
    const float *bias, float scale, float *s, int64_t lds, int64_t ldc) {
  __m512 a[6][4];
  for (int r = 0; r < RB; r++)
    for (int c = 0; c < KB; c++) a[r][c] = _mm512_setzero_ps();
  for (int64_t x = 0; x < Dh; x++) {
    __m512 k[4];
    for (int c = 0; c < KB; c++) k[c] = _mm512_loadu_ps(kt + c * Dh * 16 + x * 16);
    for (int r = 0; r < RB; r++) {
      const __m512 vq = _mm512_set1_ps(q[r * Dh + x]);
      for (int c = 0; c < KB; c++) a[r][c] = _mm512_fmadd_ps(vq, k[c], a[r][c]);
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
  for (int c = 0; c < KB; c++) {
    const __m512 b = _mm512_loadu_ps(bias + c * 16);
    const __mmask16 m = _mm512_cmp_ps_mask(b, ninf, _CMP_EQ_OQ);
    for (int r = 0; r < RB; r++)  // a masked key: -inf whatever its (stale) K row holds
      _mm512_storeu_ps(s + r * lds + c * ldc,
                       _mm512_mask_blend_ps(m, _mm512_fmadd_ps(a[r][c], vscale, b), ninf));
  }
}

/* prefix_tile16 over all N rows for KB key blocks: tiles of 6 rows, then one of the rest. Score
   (r, 16 c + t) at s + r * lds + c * ldc + t (the key blocks' layout in sp, as group_item's). */
static inline __attribute__((always_inline)) void prefix_rows16(
    const int KB, const int64_t Dh, int64_t N, const float *q, const float *kt,
    const float *bias, float scale, float *s, int64_t lds, int64_t ldc, prefetcher *pf,
    int64_t per_call) {
  int64_t r = 0;
  for (; r + 6 <= N; r += 6) {
    prefix_tile16(6, KB, Dh, q + r * Dh, kt, bias, scale, s + r * lds, lds, ldc);
    pf_issue(pf, per_call);
  }
  const float *qr = q + r * Dh;
  float *sr = s + r * lds;
  switch (N - r) {  // the last rows: one tile of a constant size
    case 5: prefix_tile16(5, KB, Dh, qr, kt, bias, scale, sr, lds, ldc); break;
    case 4: prefix_tile16(4, KB, Dh, qr, kt, bias, scale, sr, lds, ldc); break;
    case 3: prefix_tile16(3, KB, Dh, qr, kt, bias, scale, sr, lds, ldc); break;
    case 2: prefix_tile16(2, KB, Dh, qr, kt, bias, scale, sr, lds, ldc); break;
    case 1: prefix_tile16(1, KB, Dh, qr, kt, bias, scale, sr, lds, ldc); break;
  }
}
#endif

#if USE_BF16_DOT
/* prefix_block on bfloat16 pairs: q rows qp [RB, Dh / 2] and keys ktp [Dh / 2, ldk] as pairs of
   bfloat16 (element 2x in the low half), 16 keys per register. Used only where every q value
   is a bfloat16 (a bfloat16 model's q, widened) and K is bfloat16: each product is then the
   float32 kernel's exact product and a score differs from the FMA chain's only in summation
   order (pairs added odd element first, then even) and in bfloat16 subnormals read as zero.
   Each dot is one chain over the pairs in order, whatever RB. */
static inline __attribute__((always_inline)) void prefix_block_dot(
    const int RB, const int64_t Dh, const uint32_t *qp, const uint32_t *ktp, int64_t ldk,
    const float *bias, float scale, float *s, int64_t lds) {
  __m512 a[8];
  for (int r = 0; r < RB; r++) a[r] = _mm512_setzero_ps();
  for (int64_t x = 0; x < Dh / 2; x++) {
    __m512bh k = (__m512bh)_mm512_loadu_si512((const void *)(ktp + x * ldk));
    for (int r = 0; r < RB; r++)
      a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_set1_epi32((int)qp[r * (Dh / 2) + x]), k);
  }
  const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
  const __m512 b = _mm512_loadu_ps(bias);
  const __mmask16 m = _mm512_cmp_ps_mask(b, ninf, _CMP_EQ_OQ);
  for (int r = 0; r < RB; r++)  // a masked key: -inf whatever its (stale) K row holds
    _mm512_storeu_ps(s + r * lds, _mm512_mask_blend_ps(m, _mm512_fmadd_ps(a[r], vscale, b), ninf));
}

/* Prefix scores on the bfloat16 dot path: K transposed by 32-bit pairs into b->kt, the q rows
   packed into pairs, then blocks of 8 rows x 16 keys; score (r, 16 c + t) at
   b->sp[r * lsp + c * ldc + t]. */
static inline __attribute__((always_inline)) void prefix_scores_dot(
    const int64_t Dh, int64_t N, const uint16_t *pk, int64_t Lp, int64_t Lpad, float scale,
    const group_buffers *b, int64_t lsp, int64_t ldc, prefetcher *pf) {
  const int64_t P = Dh / 2;
  const uint32_t *kw = (const uint32_t *)pk;
  uint32_t *ktp = (uint32_t *)b->kt;
  int64_t j = 0;
  if (P % 8 == 0)
    for (; j + 8 <= Lp; j += 8)
      for (int64_t x = 0; x < P; x += 8)  // bit moves only: any pattern goes through unchanged
        transpose8(kw + j * P + x, P, (float *)(ktp + x * Lpad + j), Lpad, 0);
  for (int64_t x = 0; x < P; x++)
    for (int64_t t = j; t < Lpad; t++) ktp[x * Lpad + t] = t < Lp ? kw[t * P + x] : 0u;
  for (int64_t e = 0; e < N * P; e++) {
    uint32_t lo, hi;
    memcpy(&lo, b->q + 2 * e, 4), memcpy(&hi, b->q + 2 * e + 1, 4);
    b->qp[e] = (lo >> 16) | (hi & 0xFFFF0000u);
  }
  const int64_t calls = Lpad / 16 * ((N + 7) / 8), per_call = (pf_lines(pf) + calls - 1) / calls;
  for (int64_t c = 0; c < Lpad; c += 16) {
    float *s = b->sp + c / 16 * ldc;
    int any = 0;
    for (int64_t t = 0; t < 16; t++) any |= b->vis[c + t];
    if (!any) {  // 16 masked keys: no dots
      for (int64_t r = 0; r < N; r++)
        for (int64_t t = 0; t < 16; t++) s[r * lsp + t] = -INFINITY;
      continue;
    }
    const uint32_t *kt = ktp + c;
    const float *pb = b->pb + c;
    int64_t r = 0;
    for (; r + 8 <= N; r += 8) {
      prefix_block_dot(8, Dh, b->qp + r * P, kt, Lpad, pb, scale, s + r * lsp, lsp);
      pf_issue(pf, per_call);
    }
    const uint32_t *qr = b->qp + r * P;
    switch (N - r) {  // the last rows: one block of a constant size
      case 7: prefix_block_dot(7, Dh, qr, kt, Lpad, pb, scale, s + r * lsp, lsp); break;
      case 6: prefix_block_dot(6, Dh, qr, kt, Lpad, pb, scale, s + r * lsp, lsp); break;
      case 5: prefix_block_dot(5, Dh, qr, kt, Lpad, pb, scale, s + r * lsp, lsp); break;
      case 4: prefix_block_dot(4, Dh, qr, kt, Lpad, pb, scale, s + r * lsp, lsp); break;
      case 3: prefix_block_dot(3, Dh, qr, kt, Lpad, pb, scale, s + r * lsp, lsp); break;
      case 2: prefix_block_dot(2, Dh, qr, kt, Lpad, pb, scale, s + r * lsp, lsp); break;
      case 1: prefix_block_dot(1, Dh, qr, kt, Lpad, pb, scale, s + r * lsp, lsp); break;
    }
  }
}
#endif

/* o[r] (RB rows of NV * 8 columns, row stride ldo) += sum over visible keys t of p[r][t] V[t]
   (columns [0, NV * 8) of rows of Dh floats): RB rows share each V load; per output element
   one FMA chain over the keys in order, whatever the blocking. */
static inline __attribute__((always_inline)) void pv_block(
    const int RB, const int NV, const int64_t Dh, const float *p, int64_t ldp, const void *V,
    int64_t n, const unsigned char *vis, float *o, int64_t ldo, prefetcher *pf, int64_t per_key,
    const int bf16) {
  __m256 acc[3][4];
  for (int r = 0; r < RB; r++)
    for (int v = 0; v < NV; v++) acc[r][v] = _mm256_loadu_ps(o + r * ldo + v * 8);
  for (int64_t t = 0; t < n; t++) {
    pf_issue(pf, per_key);
    if (!vis[t]) continue;  // masked for every row: V[t] is never read
    __m256 b[3];
    for (int r = 0; r < RB; r++) b[r] = _mm256_broadcast_ss(p + r * ldp + t);
    for (int v = 0; v < NV; v++) {
      __m256 vv = kv_load8(V, t * Dh + v * 8, bf16);
      __asm__("" : "+x"(vv));  // one load, kept in a register for the RB rows
      for (int r = 0; r < RB; r++) acc[r][v] = _mm256_fmadd_ps(b[r], vv, acc[r][v]);
    }
  }
  for (int r = 0; r < RB; r++)
    for (int v = 0; v < NV; v++) _mm256_storeu_ps(o + r * ldo + v * 8, acc[r][v]);
}
#endif

#if HAVE_AVX2
/* pv_block over n_rows rows for the NV * 8 columns at V, o: blocks of 3 rows (12 accumulators
   at NV = 4), the last 4 rows as 2 + 2 (each V load then serves 2 rows, not 3 + 1). */
static inline __attribute__((always_inline)) void pv_cols(
    const int NV, const int64_t Dh, const float *p, int64_t ldp, int64_t n_rows, const void *V,
    int64_t n, const unsigned char *vis, float *o, prefetcher *pf, int64_t per_key,
    const int bf16) {
  int64_t i = 0;
  for (; n_rows - i > 4 || n_rows - i == 3; i += 3)
    pv_block(3, NV, Dh, p + i * ldp, ldp, V, n, vis, o + i * Dh, Dh, pf, per_key, bf16);
  for (; n_rows - i >= 2; i += 2)
    pv_block(2, NV, Dh, p + i * ldp, ldp, V, n, vis, o + i * Dh, Dh, pf, per_key, bf16);
  if (i < n_rows)
    pv_block(1, NV, Dh, p + i * ldp, ldp, V, n, vis, o + i * Dh, Dh, pf, per_key, bf16);
}
#endif

#if HAVE_AVX512
/* pv_block in 16-lane registers: RB rows of NV * 16 columns, p(r, 16 c + u) at
   p[c * cs + r * rs + u]: row-major probabilities (rows ldp apart) are (cs, rs) = (16, ldp);
   by key blocks (block c at p + c * ldc, each key's RB probabilities at constant offsets from
   one pointer) (ldc, 16). Each output element is the same FMA chain over the keys in order as
   in pv_block, whatever the layout or blocking, so the results are bitwise the same. */
static inline __attribute__((always_inline)) void pv_block16(
    const int RB, const int NV, const int64_t Dh, const float *p, const int64_t cs,
    const int64_t rs, const void *V, int64_t n, const unsigned char *vis, float *o,
    prefetcher *pf, int64_t per_key, const int bf16) {
  __m512 acc[12][2];
  for (int r = 0; r < RB; r++)
    for (int v = 0; v < NV; v++) acc[r][v] = _mm512_loadu_ps(o + r * Dh + v * 16);
  for (int64_t t = 0; t < n; t++) {
    pf_issue(pf, per_key);
    if (!vis[t]) continue;  // masked for every row: V[t] is never read
    __m512 vv[2];
    for (int v = 0; v < NV; v++)
      vv[v] = bf16 ? bf16_load16((const uint16_t *)V + t * Dh + v * 16)
                   : _mm512_loadu_ps((const float *)V + t * Dh + v * 16);
    // p(0, t); at cs == 16 (row-major) the general address is p + t too, written so that the
    // row-major loop stays one pointer increment (the nested c / u loop cost ~1 % there)
    const float *pt = cs == 16 ? p + t : p + (t >> 4) * cs + (t & 15);
    for (int r = 0; r < RB; r++) {
      const __m512 b = _mm512_set1_ps(pt[r * rs]);
      for (int v = 0; v < NV; v++) acc[r][v] = _mm512_fmadd_ps(b, vv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < RB; r++)
    for (int v = 0; v < NV; v++) _mm512_storeu_ps(o + r * Dh + v * 16, acc[r][v]);
}

/* pv_block16 over n_rows rows for the NV * 16 columns at V, o: blocks of 6 rows, then one
   block of the rest. */
static inline __attribute__((always_inline)) void pv_cols16(
    const int NV, const int64_t Dh, const float *p, int64_t ldp, int64_t n_rows, const void *V,
    int64_t n, const unsigned char *vis, float *o, prefetcher *pf, int64_t per_key,
    const int bf16) {
  int64_t i = 0;
  for (; i + 6 <= n_rows; i += 6)
    pv_block16(6, NV, Dh, p + i * ldp, 16, ldp, V, n, vis, o + i * Dh, pf, per_key, bf16);
  const float *pr = p + i * ldp;
  float *orr = o + i * Dh;
  switch (n_rows - i) {
#define REST(k)                                                                   \
  case k: pv_block16(k, NV, Dh, pr, 16, ldp, V, n, vis, orr, pf, per_key, bf16); break;
    REST(5) REST(4) REST(3) REST(2) REST(1)
#undef REST
  }
}
#endif

#if HAVE_AVX512
/* pv_block16 over N rows of probabilities by key blocks for the NV * 16 columns at V, o:
   blocks of 12 rows (24 accumulators at NV = 2: per key NV V loads and 12 probabilities feed
   24 FMAs, and V is read half as often as with 6-row blocks), then one block of the rest. With
   rows ldp apart (pv_cols16) the compiler kept the row offsets on the stack and reloaded them
   for every key, and more than 6 rows a block did not fit: hence the key-block layout. */
static inline __attribute__((always_inline)) void pv_prefix_cols16(
    const int NV, const int64_t Dh, const float *p, int64_t ldc, int64_t N, const void *V,
    int64_t n, const unsigned char *vis, float *o, prefetcher *pf, int64_t per_key,
    const int bf16) {
  int64_t i = 0;
  for (; i + 12 <= N; i += 12)
    pv_block16(12, NV, Dh, p + i * 16, ldc, 16, V, n, vis, o + i * Dh, pf, per_key, bf16);
  const float *pr = p + i * 16;
  float *orr = o + i * Dh;
  switch (N - i) {  // the last rows: one block of a constant size
#define REST(k)                                                                   \
  case k: pv_block16(k, NV, Dh, pr, ldc, 16, V, n, vis, orr, pf, per_key, bf16); break;
    REST(11) REST(10) REST(9) REST(8) REST(7) REST(6) REST(5) REST(4) REST(3) REST(2) REST(1)
#undef REST
  }
}

/* o [N, Dh] += P @ V [n, Dh] for the prefix probabilities by key blocks (group_item's sp: block
   c at p + c * ldc, Dh a multiple of 16), 32 (then 16) columns at a time. */
static inline __attribute__((always_inline)) void pv_prefix16(
    const int64_t Dh, const float *p, int64_t ldc, int64_t N, const void *V, int64_t n,
    const unsigned char *vis, float *o, prefetcher *pf, const int bf16) {
  const int64_t visits = ((N + 11) / 12) * ((Dh + 31) / 32) * n;
  const int64_t per_key = visits > 0 ? (pf_lines(pf) + visits - 1) / visits : 0;
  for (int64_t c = 0; c < Dh; c += 32) {
    const void *Vc = kv_at(V, c, bf16);
    if (Dh - c >= 32) pv_prefix_cols16(2, Dh, p, ldc, N, Vc, n, vis, o + c, pf, per_key, bf16);
    else pv_prefix_cols16(1, Dh, p, ldc, N, Vc, n, vis, o + c, pf, per_key, bf16);
  }
}
#endif

#if HAVE_AMX
/* ---- The prefix part on AMX tiles (bfloat16 K / V, q of bfloat16 values, Dh % 32 == 0, at
   most 128). S = Q K^T and O = P V are tile products (_tile_dpbf16ps: bfloat16 pairs, float32
   sums); the scale, bias, mask and softmax stay in float32 AVX-512 between them. Tiles as
   amx_configure sets them (16 rows x 64 bytes): C tiles 0-3, A 4, B 5. An item's N rows are
   padded to Npad (a multiple of 16) with zero q rows, whose results are never read.

   Each row's result is fixed whatever rows share its tiles (a tile product computes every C
   row from its own A row), so it does not depend on the number of threads. The probabilities
   e^(s - m) are rounded to bfloat16 for the P V product (as prefill_attention.c's item_amx
   and torch's bfloat16 attention round them) and the row's sum adds those rounded values; the
   suffix part stays in float32. ---- */

/* K^T by bfloat16 pairs for the B tiles, block-major: block c (keys 16 c .. 16 c + 15) is the
   [Dh / 2, 16] words at ktw + c * Dh * 8, word (p, t) = pair p (dims 2p, 2p + 1) of key t;
   keys past Lp zero. Bit moves only (transpose8 on 32-bit words). */
static inline __attribute__((always_inline)) void amx_pack_k(const int64_t Dh, const uint16_t *pk,
                                                             int64_t Lp, int64_t Lpad,
                                                             uint32_t *ktw) {
  const int64_t P = Dh / 2;
  const uint32_t *kw = (const uint32_t *)pk;
  int64_t j = 0;
  for (; j + 8 <= Lp; j += 8)
    for (int64_t x = 0; x < P; x += 8)
      transpose8(kw + j * P + x, P, (float *)(ktw + (j / 16) * P * 16 + x * 16 + j % 16), 16, 0);
  for (int64_t t = j; t < Lpad; t++)
    for (int64_t x = 0; x < P; x++)
      ktw[(t / 16) * P * 16 + x * 16 + t % 16] = t < Lp ? kw[t * P + x] : 0u;
}

/* Raw dots <q_r, k_t> of the Npad rows of qb (bfloat16 [Npad, Dh]) into sp by key blocks: block
   c of rows r0 .. r0 + 15 is the 16 x 16 floats at sp + c * ldc + r0 * 16 (the blocked layout
   of group_item, written by one tile store). Four key blocks (C tiles) at a time. */
static inline __attribute__((always_inline)) void amx_prefix_dots(
    const int64_t Dh, int64_t Npad, const uint16_t *qb, const uint32_t *ktw, int64_t blocks,
    float *sp, int64_t ldc, prefetcher *pf, int64_t per_tile) {
  for (int64_t i = 0; i < Npad; i += 16)
    for (int64_t c = 0; c < blocks; c += 4) {
      const int NC = blocks - c < 4 ? (int)(blocks - c) : 4;
#define ZERO(j) _tile_zero(j)
      FOR_TILES(NC, ZERO);
#undef ZERO
      for (int64_t x = 0; x < Dh; x += 32) {
        _tile_loadd(4, qb + i * Dh + x, Dh * 2);
#define DOT(j)                                                      \
  do {                                                              \
    _tile_loadd(5, ktw + (c + (j)) * Dh * 8 + x / 2 * 16, 64);      \
    _tile_dpbf16ps(j, 4, 5);                                        \
  } while (0)
        FOR_TILES(NC, DOT);
#undef DOT
      }
#define STORE(j) _tile_stored(j, sp + (c + (j)) * ldc + i * 16, 64)
      FOR_TILES(NC, STORE);
#undef STORE
      pf_issue(pf, per_tile);
    }
}

/* Row r of the raw dots (blocks of 16 at s + c * ldc) -> scores dot * scale + bias (-inf where
   masked, whatever the dot: stale K may overflow), in place; returns their maximum. */
static inline float amx_scores_row(float *s, int64_t ldc, int64_t blocks, const float *pb,
                                   float scale) {
  const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
  __m512 vm = ninf;
  for (int64_t c = 0; c < blocks; c++) {
    const __m512 b = _mm512_loadu_ps(pb + c * 16);
    const __mmask16 m = _mm512_cmp_ps_mask(b, ninf, _CMP_EQ_OQ);
    const __m512 v =
        _mm512_mask_blend_ps(m, _mm512_fmadd_ps(_mm512_loadu_ps(s + c * ldc), vscale, b), ninf);
    _mm512_storeu_ps(s + c * ldc, v);
    vm = _mm512_max_ps(vm, v);
  }
  return _mm512_reduce_max_ps(vm);
}

/* Row r's scores (blocks of 16 at s + c * ldc) -> bfloat16 probabilities e^(s - m), rounded to
   nearest even, into p's A-tile layout (key block u of 32: row r's 32 at p + u * ldu + r * 32;
   the second half of a last odd block zero); returns the sum of the rounded values (one 16-lane
   chain over the blocks in order). */
static inline float amx_probabilities_row(const float *s, int64_t ldc, int64_t blocks, float m,
                                          uint16_t *p, int64_t ldu) {
  const __m512 vmax = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t c = 0; c < blocks; c++) {
    const __m256bh e =
        _mm512_cvtneps_pbh(exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + c * ldc), vmax)));
    _mm256_storeu_si256((__m256i *)(p + c / 2 * ldu + c % 2 * 16), (__m256i)e);
    vsum = _mm512_add_ps(vsum, _mm512_cvtpbh_ps(e));
  }
  if (blocks & 1)
    _mm256_storeu_si256((__m256i *)(p + blocks / 2 * ldu + 16), _mm256_setzero_si256());
  return _mm512_reduce_add_ps(vsum);
}

/* V by key pairs for the B tiles: vw[u * Dh + x] = V[2u][x] | V[2u + 1][x] << 16 for the
   pairs u < Lp32 / 2; a key not visible to any row (vis) or past Lp is zero, its V row never
   read. */
static inline __attribute__((always_inline)) void amx_pack_v(const int64_t Dh, const uint16_t *pv,
                                                             int64_t Lp, int64_t Lp32,
                                                             const unsigned char *vis,
                                                             uint32_t *vw) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t t = 0; t < Lp32; t += 2) {
    const int v0 = t < Lp && vis[t], v1 = t + 1 < Lp && vis[t + 1];
    for (int64_t x = 0; x < Dh; x += 16) {
      const __m512i lo =
          v0 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(pv + t * Dh + x))) : zero;
      const __m512i hi =
          v1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(pv + (t + 1) * Dh + x)))
             : zero;
      _mm512_storeu_si512((void *)(vw + t / 2 * Dh + x),
                          _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

/* o [Npad, Dh] = P V over the Lp32 / 32 key blocks (p in amx_probabilities_row's layout, vw
   amx_pack_v's), 64 columns (4 C tiles) at a time; each element one chain of tile products
   over the key blocks in order. Blocks whose 32 keys no row sees are skipped (their P and V are
   zero: the sums would not change). */
static inline __attribute__((always_inline)) void amx_pv(const int64_t Dh, int64_t Npad,
                                                         int64_t Lp32, const uint16_t *p,
                                                         const uint32_t *vw,
                                                         const unsigned char *vis32, float *o,
                                                         prefetcher *pf, int64_t per_block) {
  for (int64_t i = 0; i < Npad; i += 16)
    for (int64_t c = 0; c < Dh; c += 64) {
      const int NC = Dh - c >= 64 ? 4 : (int)(Dh - c) / 16;
      float *oc = o + i * Dh + c;
#define ZERO(j) _tile_zero(j)
      FOR_TILES(NC, ZERO);
#undef ZERO
      for (int64_t u = 0; u < Lp32 / 32; u++) {
        pf_issue(pf, per_block);
        if (!vis32[u]) continue;
        _tile_loadd(4, p + u * Npad * 32 + i * 32, 64);
        amx_dot_values(NC, vw, u, c, Dh);
      }
      amx_store_c(NC, oc, Dh);
    }
}
#endif

/* o [n_rows, Dh] += p [n_rows, ldp] @ V [n, Dh] over the keys with vis[t]; issues the pending
   prefetches of pf spread over the keys it visits. */
static inline __attribute__((always_inline)) void pv_rows(const int64_t Dh, const float *p,
                                                          int64_t ldp, int64_t n_rows,
                                                          const void *V, int64_t n,
                                                          const unsigned char *vis, float *o,
                                                          prefetcher *pf, const int bf16) {
#if HAVE_AVX512
  if (Dh % 16 == 0) {
    const int64_t visits = ((n_rows + 5) / 6) * ((Dh + 31) / 32) * n;
    const int64_t per_key = visits > 0 ? (pf_lines(pf) + visits - 1) / visits : 0;
    for (int64_t c = 0; c < Dh; c += 32) {  // columns 32 at a time (2 vectors), then 16
      const void *Vc = kv_at(V, c, bf16);
      if (Dh - c >= 32) pv_cols16(2, Dh, p, ldp, n_rows, Vc, n, vis, o + c, pf, per_key, bf16);
      else pv_cols16(1, Dh, p, ldp, n_rows, Vc, n, vis, o + c, pf, per_key, bf16);
    }
    return;
  }
#endif
  const int64_t visits = ((n_rows + 2) / 3) * ((Dh + 31) / 32) * n;
  const int64_t per_key = visits > 0 ? (pf_lines(pf) + visits - 1) / visits : 0;
#if HAVE_AVX2
  if (Dh % 8 == 0) {
    for (int64_t c = 0; c < Dh; c += 32) {  // columns 32 at a time (4 vectors), then the rest
      const void *Vc = kv_at(V, c, bf16);
      if (Dh - c >= 32) pv_cols(4, Dh, p, ldp, n_rows, Vc, n, vis, o + c, pf, per_key, bf16);
      else if (Dh - c == 24) pv_cols(3, Dh, p, ldp, n_rows, Vc, n, vis, o + c, pf, per_key, bf16);
      else if (Dh - c == 16) pv_cols(2, Dh, p, ldp, n_rows, Vc, n, vis, o + c, pf, per_key, bf16);
      else pv_cols(1, Dh, p, ldp, n_rows, Vc, n, vis, o + c, pf, per_key, bf16);
    }
    return;
  }
#endif
  for (int64_t r = 0; r < n_rows; r++)
    for (int64_t t = 0; t < n; t++) {
      pf_issue(pf, per_key);
      if (!vis[t]) continue;
      const float pt = p[r * ldp + t];
      for (int64_t x = 0; x < Dh; x++) o[r * Dh + x] += pt * kv_get(V, t * Dh + x, bf16);
    }
}


/* One group item: the rows of n members (sequences mem[0..n)) of one group for KV head h. The
   prefix scores of all n * R rows come from one pass over the group's prefix K (transposed
   once per item), and its PV from one pass over prefix V with several rows per V load; each
   member's suffix is then scored and multiplied on its own. One softmax per row over
   prefix ++ suffix, as in `item`. b->q .. b->vis hold at least n * R rows. */
static inline __attribute__((always_inline)) void group_item(
    const int64_t Dh, int64_t R, int64_t rows_per_bias, const float *q, int64_t q_d,
    const int64_t *mem, int64_t n, int64_t h, const void *pk, const void *pv, int64_t Lp,
    int64_t Lpad, const float *pbias, const void *sk, const void *sv, int64_t s_h,
    int64_t s_d, int64_t Ls, const float *sbias, int64_t sbias_d, int64_t Hkv, float scale,
    float *out, const group_buffers *b, const void *next_pk, const int bf16, const int dot,
    const int amx) {
  const int64_t N = n * R, Q = R / rows_per_bias, es = bf16 ? 2 : 4;
  // the AMX path pads the rows to whole tiles, the keys to whole 32-key blocks of P
  const int64_t Npad = (N + 15) / 16 * 16, Lp32 = (Lp + 31) / 32 * 32;
  (void)Npad, (void)Lp32, (void)amx;  // unused in builds without AMX
  // sp by key blocks where the 16-lane kernels cover the head: score (r, 16 c + t) at
  // sp[c * ldc_sp + r * 16 + t], so P @ V finds a block's rows at constant offsets from one
  // pointer; ldc_sp = (N + 1) * 16, not N * 16, for the softmax's pass along a row (blocks
  // N * 64 bytes apart: 2 KiB at N = 32, 2 of L1's 64 sets). Else row-major [N, lsp].
  const int blocked = HAVE_AVX512 && Dh % 16 == 0;
  const int64_t ldc_sp = (amx ? Npad : N) * 16 + 16;
  (void)blocked, (void)ldc_sp;  // unused in builds without AVX-512
  prefetcher pf = {0}, pf_v = {0};  // prefix K now; prefix V, suffix K; suffix V
  pf_add(&pf, pk, Lp * Dh * es);
  pf_issue(&pf, pf_lines(&pf));
  pf_add(&pf, pv, Lp * Dh * es);
  for (int64_t i = 0; i < n; i++) {
    pf_add(&pf, kv_at(sk, h * s_h + mem[i] * s_d, bf16), Ls * Dh * es);
    pf_add(&pf_v, kv_at(sv, h * s_h + mem[i] * s_d, bf16), Ls * Dh * es);
  }
  pf_add(&pf_v, next_pk, Lp * Dh * es);  // the next item's first reads
  for (int64_t i = 0; i < n; i++) {  // the query rows, member after member
    const float *qi = q + mem[i] * q_d + h * R * Dh;
    for (int64_t e = 0; e < R * Dh; e++) b->q[i * R * Dh + e] = qi[e];
  }
  for (int64_t j = 0; j < Lpad; j++) {
    b->pb[j] = j < Lp ? pbias[j] : -INFINITY;
    b->vis[j] = b->pb[j] != -INFINITY;
  }
  // prefix scores into sp (keys past Lp -inf)
#if HAVE_AVX2
#if HAVE_AMX
  if (amx) {
    uint16_t *qb = (uint16_t *)b->qp;  // q as bfloat16 (its values are: exact), zero past N
    for (int64_t e = 0; e < N * Dh; e++) {
      uint32_t w;
      memcpy(&w, b->q + e, sizeof w);
      qb[e] = (uint16_t)(w >> 16);
    }
    memset(qb + N * Dh, 0, sizeof(uint16_t) * (size_t)((Npad - N) * Dh));
    amx_pack_k(Dh, (const uint16_t *)pk, Lp, Lpad, (uint32_t *)b->kt);
    const int64_t tiles = Npad / 16 * ((Lpad / 16 + 3) / 4);
    amx_prefix_dots(Dh, Npad, qb, (const uint32_t *)b->kt, Lpad / 16, b->sp, ldc_sp, &pf,
                    (pf_lines(&pf) + tiles - 1) / tiles);
  }
#endif
#if USE_BF16_DOT
  if (dot)
    prefix_scores_dot(Dh, N, (const uint16_t *)pk, Lp, Lpad, scale, b, blocked ? 16 : b->lsp,
                      blocked ? ldc_sp : 16, &pf);
#endif
  if (!dot && !amx) {
    // K^T block-major: keys in blocks of 16, block c the [Dh, 16] floats at kt + c * Dh * 16.
    // A block's rows are contiguous (one row-major [Dh, Lpad] K^T put the Dh rows a block
    // reads Lpad * 4 bytes apart: at Lpad = 512, 2 of L1's 64 sets for all of them).
    {
      int64_t j = 0;
      if (Dh % 8 == 0)
        for (; j + 8 <= Lp; j += 8)
          for (int64_t x = 0; x < Dh; x += 8)
            transpose8(kv_at(pk, j * Dh + x, bf16), Dh,
                       b->kt + (j / 16) * Dh * 16 + x * 16 + j % 16, 16, bf16);
      for (int64_t t = j; t < Lpad; t++)
        for (int64_t x = 0; x < Dh; x++)
          b->kt[(t / 16) * Dh * 16 + x * 16 + t % 16] = t < Lp ? kv_get(pk, t * Dh + x, bf16) : 0.f;
    }
    const int64_t blocks = Lpad / 16, lsp = b->lsp;
#if HAVE_AVX512
    const int64_t lds = blocked ? 16 : lsp, ldc = blocked ? ldc_sp : 16;
    enum { KB = 4 };  // key blocks a tile: with 6 rows, 24 accumulators + 4 key vectors
    const int64_t calls = (blocks + KB - 1) / KB * ((N + 5) / 6);
    const int64_t per_call = (pf_lines(&pf) + calls - 1) / calls;
    for (int64_t c = 0; c < blocks; c += KB) {
      const int64_t kb = blocks - c < KB ? blocks - c : KB;
      float *s = b->sp + c * ldc;
      const float *kt = b->kt + c * Dh * 16, *pb = b->pb + c * 16;
      int any = 0;
      for (int64_t t = 0; t < kb * 16; t++) any |= b->vis[c * 16 + t];
      if (!any) {  // masked keys only: no dots
        for (int64_t r = 0; r < N; r++)
          for (int64_t u = 0; u < kb; u++)
            for (int64_t t = 0; t < 16; t++) s[r * lds + u * ldc + t] = -INFINITY;
        continue;
      }
      switch (kb) {
        case 4: prefix_rows16(4, Dh, N, b->q, kt, pb, scale, s, lds, ldc, &pf, per_call); break;
        case 3: prefix_rows16(3, Dh, N, b->q, kt, pb, scale, s, lds, ldc, &pf, per_call); break;
        case 2: prefix_rows16(2, Dh, N, b->q, kt, pb, scale, s, lds, ldc, &pf, per_call); break;
        case 1: prefix_rows16(1, Dh, N, b->q, kt, pb, scale, s, lds, ldc, &pf, per_call); break;
      }
    }
#else
    const int64_t calls = blocks * ((N + 5) / 6), per_call = (pf_lines(&pf) + calls - 1) / calls;
    for (int64_t c = 0; c < blocks; c++) {
      float *s = b->sp + c * 16;
      const float *kt = b->kt + c * Dh * 16, *pb = b->pb + c * 16;
      int any = 0;
      for (int64_t t = 0; t < 16; t++) any |= b->vis[c * 16 + t];
      if (!any) {  // 16 masked keys: no dots
        for (int64_t r = 0; r < N; r++)
          for (int64_t t = 0; t < 16; t++) s[r * lsp + t] = -INFINITY;
        continue;
      }
      int64_t r = 0;
      for (; r + 6 <= N; r += 6) {
        prefix_block(6, Dh, b->q + r * Dh, kt, 16, pb, scale, s + r * lsp, lsp);
        pf_issue(&pf, per_call);
      }
      const float *qr = b->q + r * Dh;
      switch (N - r) {  // the last rows: one block of a constant size
        case 5: prefix_block(5, Dh, qr, kt, 16, pb, scale, s + r * lsp, lsp); break;
        case 4: prefix_block(4, Dh, qr, kt, 16, pb, scale, s + r * lsp, lsp); break;
        case 3: prefix_block(3, Dh, qr, kt, 16, pb, scale, s + r * lsp, lsp); break;
        case 2: prefix_block(2, Dh, qr, kt, 16, pb, scale, s + r * lsp, lsp); break;
        case 1: prefix_block(1, Dh, qr, kt, 16, pb, scale, s + r * lsp, lsp); break;
      }
    }
#endif
  }
#else
  pf_issue(&pf, pf_lines(&pf));
  for (int64_t r = 0; r < N; r++)
    for (int64_t j = 0; j < Lpad; j++) {
      if (b->pb[j] == -INFINITY) {
        b->sp[r * b->lsp + j] = -INFINITY;
        continue;
      }
      float acc = 0.f;
      for (int64_t x = 0; x < Dh; x++) acc += b->q[r * Dh + x] * kv_get(pk, j * Dh + x, bf16);
      b->sp[r * b->lsp + j] = acc * scale + b->pb[j];
    }
#endif
  pf_issue(&pf, pf_lines(&pf));  // whatever is left (masked blocks issue none)
  // each member's suffix scores, then one softmax per row over prefix ++ suffix
  for (int64_t i = 0; i < n; i++) {
    const int64_t d = mem[i];
    scores(b->q + i * R * Dh, R, Dh, kv_at(sk, h * s_h + d * s_d, bf16), Ls, sbias + d * sbias_d,
           Ls, rows_per_bias, scale, b->ss + i * R * Ls, Ls, bf16);
  }
  for (int64_t r = 0; r < N; r++) {
    float *ss = b->ss + r * Ls;
    const float m1 = row_max(ss, Ls);
#if HAVE_AVX512
    if (blocked) {
      float *sp = b->sp + r * 16;
#if HAVE_AMX
      if (amx) {  // scale, bias and mask applied here (the tiles store raw dots)
        const float m0 = amx_scores_row(sp, ldc_sp, Lpad / 16, b->pb, scale);
        const float m = m0 > m1 ? m0 : m1;
        b->inv[r] = 1.f / (amx_probabilities_row(sp, ldc_sp, Lpad / 16, m, b->pw + r * 32,
                                                 Npad * 32) +
                           exp_sum(ss, Ls, m));
        continue;
      }
#endif
      const float m0 = row_max_blocked(sp, ldc_sp, Lpad), m = m0 > m1 ? m0 : m1;
      b->inv[r] = 1.f / (exp_sum_blocked(sp, ldc_sp, Lpad, m) + exp_sum(ss, Ls, m));
      continue;
    }
#endif
    float *sp = b->sp + r * b->lsp;
    const float m0 = row_max(sp, Lp), m = m0 > m1 ? m0 : m1;
    const float sum = exp_sum(sp, Lp, m) + exp_sum(ss, Ls, m);
    b->inv[r] = 1.f / sum;
  }
  // prefix PV for all rows, then each member's suffix PV and normalisation
  for (int64_t e = 0; e < N * Dh; e++) b->o[e] = 0.f;
#if HAVE_AMX
  if (amx) {
    for (int64_t u = 0; u < Lp32 / 32; u++) {  // padding rows: zero probabilities
      memset(b->pw + u * Npad * 32 + N * 32, 0, sizeof(uint16_t) * (size_t)((Npad - N) * 32));
      unsigned char any = 0;
      for (int64_t t = 32 * u; t < 32 * u + 32 && t < Lpad; t++) any |= b->vis[t];
      b->vis32[u] = any;
    }
    amx_pack_v(Dh, (const uint16_t *)pv, Lp, Lp32, b->vis, b->vw);
    const int64_t visits = Npad / 16 * ((Dh + 63) / 64) * (Lp32 / 32);
    amx_pv(Dh, Npad, Lp32, b->pw, b->vw, b->vis32, b->o, &pf_v,
           visits > 0 ? (pf_lines(&pf_v) + visits - 1) / visits : 0);
  } else
#endif
#if HAVE_AVX512
  if (blocked) pv_prefix16(Dh, b->sp, ldc_sp, N, pv, Lp, b->vis, b->o, &pf_v, bf16);
  else
#endif
    pv_rows(Dh, b->sp, b->lsp, N, pv, Lp, b->vis, b->o, &pf_v, bf16);
  unsigned char *vis = b->vis + Lpad;
  for (int64_t i = 0; i < n; i++) {
    const int64_t d = mem[i];
    const float *sb = sbias + d * sbias_d;
    for (int64_t t = 0; t < Ls; t++) {
      unsigned char any = 0;
      for (int64_t u = 0; u < Q; u++) any |= sb[u * Ls + t] != -INFINITY;
      vis[t] = any;
    }
    float *o = b->o + i * R * Dh;
    pv_rows(Dh, b->ss + i * R * Ls, Ls, R, kv_at(sv, h * s_h + d * s_d, bf16), Ls, vis, o, &pf_v,
            bf16);
    float *dst = out + (d * Hkv + h) * R * Dh;
    for (int64_t r = 0; r < R; r++)
      for (int64_t x = 0; x < Dh; x++) dst[r * Dh + x] = o[r * Dh + x] * b->inv[i * R + r];
  }
  pf_issue(&pf_v, pf_lines(&pf_v));
}

/* q [D, Hkv, R, Dh]: sequence d's Hkv * R rows of Dh contiguous floats at q + d * q_d (the
   decode tokens' q heads read in place from the fused projection's output); suffix K, V:
   element (h, d, t, x) at h * s_h + d * s_d + t * Dh + x; sbias [D, R / rows_per_bias, Ls];
   prefix K, V [Hkv, G, Lp, Dh] at h * p_h + g * p_g; pbias [G, Lp]; group_of [D], each in
   [0, G = num_groups); out [D, Hkv, R, Dh] contiguous. Returns 0; -1 if a buffer could not be
   allocated (out is then incomplete); -2, writing nothing, if a group index is out of range.

   With a prefix (Lp > 0) a work item is (a run of at most `chunk` members of one group, KV
   head): the members of a group in sequence order (any order in the batch), split into runs so
   that a batch of few large groups still spreads over the threads. Without one it is
   (sequence, KV head). */
static int cascade_decode(int64_t D, int64_t Hkv, int64_t R, int64_t Dh, int64_t rows_per_bias,
                          const float *q, int64_t q_d, const void *sk, const void *sv,
                          int64_t s_h, int64_t s_d, int64_t Ls, const float *sbias,
                          const void *pk, const void *pv, int64_t p_h, int64_t p_g, int64_t Lp,
                          const float *pbias, const int64_t *group_of, int64_t num_groups,
                          float scale, float *out, int num_threads, int bf16, int dot, int amx) {
  const int64_t L = Lp + Ls, sbias_d = (R / rows_per_bias) * Ls;
  if (Lp > 0)
    for (int64_t d = 0; d < D; d++)
      if (group_of[d] < 0 || group_of[d] >= num_groups) return -2;  // nothing written
  int failed = 0;
  if (Lp == 0) {
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
      float *s = (float *)malloc(sizeof(float) * (size_t)(R * (L + 1)));
      failed = s == NULL;
#pragma omp for schedule(static)
      for (int64_t it = 0; it < D * Hkv; it++) {
        if (s == NULL) continue;
        const int64_t d = it / Hkv, h = it % Hkv;
        const float *qi = q + d * q_d + h * R * Dh;
        const void *ski = kv_at(sk, h * s_h + d * s_d, bf16);
        const void *svi = kv_at(sv, h * s_h + d * s_d, bf16);
        const float *sb = sbias + d * sbias_d;
        float *o = out + it * R * Dh;
        // constant head sizes (and element types) let the compiler unroll and keep acc in
        // registers
#define ITEM(DH, BF16) \
  item(DH, R, rows_per_bias, qi, pk, pv, 0, pbias, ski, svi, Ls, sb, scale, o, s, BF16)
        if (bf16) switch (Dh) {
            case 32: ITEM(32, 1); break;
            case 64: ITEM(64, 1); break;
            case 128: ITEM(128, 1); break;
            default: ITEM(Dh, 1);
          }
        else switch (Dh) {
            case 32: ITEM(32, 0); break;
            case 64: ITEM(64, 0); break;
            case 128: ITEM(128, 0); break;
            default: ITEM(Dh, 0);
          }
#undef ITEM
      }
      free(s);
    }
    return failed ? -1 : 0;
  }
  // Members of each group in sequence order (a counting sort of group_of), cut into runs of at
  // most `chunk` members: at most 64 rows per item (buffers stay in L1/L2), and small enough
  // that there are at least ~4 items per thread.
  int64_t chunk = R >= 64 ? 1 : 64 / R;
  const int64_t balance = D * Hkv / (4 * (int64_t)(num_threads > 0 ? num_threads : 1));
  if (balance < chunk) chunk = balance > 1 ? balance : 1;
  int64_t *start = (int64_t *)calloc((size_t)(num_groups + 1), sizeof(int64_t));
  int64_t *order = (int64_t *)malloc(sizeof(int64_t) * (size_t)(D > 0 ? D : 1));
  int64_t *runs = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * (D > 0 ? D : 1)));
  if (start == NULL || order == NULL || runs == NULL) {
    free(start), free(order), free(runs);
    return -1;
  }
  for (int64_t d = 0; d < D; d++) start[group_of[d] + 1]++;
  for (int64_t g = 0; g < num_groups; g++) start[g + 1] += start[g];
  for (int64_t d = 0; d < D; d++) order[start[group_of[d]]++] = d;  // start[g] -> end of g
  int64_t num_runs = 0;
  for (int64_t g = 0, begin = 0; g < num_groups; begin = start[g], g++)
    for (int64_t i = begin; i < start[g]; i += chunk) {
      runs[2 * num_runs] = i;
      runs[2 * num_runs + 1] = start[g] - i < chunk ? start[g] - i : chunk;
      num_runs++;
    }
  // rows16: an item's rows padded to whole tiles (the AMX path's q, scores and outputs)
  const int64_t rows = chunk * R, rows16 = (rows + 15) / 16 * 16, Lpad = (Lp + 15) / 16 * 16;
  const int64_t Lp32 = (Lp + 31) / 32 * 32;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
  {
    group_buffers b = {0};
    const size_t floats =
        (size_t)(rows16 * Dh + Dh * Lpad + Lpad + (rows16 + 1) * (Lpad + 16) + rows * Ls +
                 rows16 * Dh + rows + rows16 * (Dh / 2) + rows16 * Lp32 / 2 + Lp32 / 2 * Dh);
    float *buf = (float *)malloc(sizeof(float) * floats + (size_t)(Lpad + Ls + Lp32 / 32));
    failed = buf == NULL;
    if (buf != NULL) {
      b.q = buf, b.kt = b.q + rows16 * Dh, b.pb = b.kt + Dh * Lpad, b.sp = b.pb + Lpad;
      b.lsp = Lpad + 16, b.ss = b.sp + (rows16 + 1) * b.lsp, b.o = b.ss + rows * Ls;
      b.inv = b.o + rows16 * Dh;
      b.qp = (uint32_t *)(b.inv + rows);
      b.pw = (uint16_t *)(b.qp + rows16 * (Dh / 2));
      b.vw = (uint32_t *)(b.pw + rows16 * Lp32);
      b.vis = (unsigned char *)(b.vw + Lp32 / 2 * Dh);
      b.vis32 = b.vis + Lpad + Ls;
    }
#if HAVE_AMX
    if (amx) amx_configure();
#endif
#pragma omp for schedule(static)
    for (int64_t it = 0; it < num_runs * Hkv; it++) {
      if (buf == NULL) continue;
      const int64_t *run = runs + 2 * (it / Hkv), h = it % Hkv;
      const int64_t *mem = order + run[0], n = run[1], g = group_of[mem[0]];
      const void *pki = kv_at(pk, h * p_h + g * p_g, bf16);
      const void *pvi = kv_at(pv, h * p_h + g * p_g, bf16), *next_pk = NULL;
      const float *pb = pbias + g * Lp;
      // the tiles for a group of at least AMX_MIN_ROWS rows: decided by the group's size and
      // the call's prefix, not the run's size (which depends on the number of threads)
      const int amx_g = amx && (start[g] - (g > 0 ? start[g - 1] : 0)) * R >= AMX_MIN_ROWS &&
                        Lp >= AMX_MIN_PREFIX;
      if (it + 1 < num_runs * Hkv)
        next_pk = kv_at(pk, ((it + 1) % Hkv) * p_h +
                                group_of[order[runs[2 * ((it + 1) / Hkv)]]] * p_g, bf16);
#define GROUP_ITEM(DH, BF16)                                                                  \
  group_item(DH, R, rows_per_bias, q, q_d, mem, n, h, pki, pvi, Lp, Lpad, pb, sk, sv, s_h, s_d, \
             Ls, sbias, sbias_d, Hkv, scale, out, &b, next_pk, BF16, dot, amx_g)
      if (bf16) switch (Dh) {  // as in `item`
          case 32: GROUP_ITEM(32, 1); break;
          case 64: GROUP_ITEM(64, 1); break;
          case 128: GROUP_ITEM(128, 1); break;
          default: GROUP_ITEM(Dh, 1);
        }
      else switch (Dh) {
          case 32: GROUP_ITEM(32, 0); break;
          case 64: GROUP_ITEM(64, 0); break;
          case 128: GROUP_ITEM(128, 0); break;
          default: GROUP_ITEM(Dh, 0);
        }
#undef GROUP_ITEM
    }
#if HAVE_AMX
    if (amx) _tile_release();
#endif
    free(buf);
  }
  free(start), free(order), free(runs);
  return failed ? -1 : 0;
}

/* The entry points: K and V float32, or K and V bfloat16 (the pool's rows read as stored). */
int cascade_decode_f32(int64_t D, int64_t Hkv, int64_t R, int64_t Dh, int64_t rows_per_bias,
                       const float *q, int64_t q_d, const float *sk, const float *sv, int64_t s_h,
                       int64_t s_d, int64_t Ls, const float *sbias, const float *pk,
                       const float *pv, int64_t p_h, int64_t p_g, int64_t Lp, const float *pbias,
                       const int64_t *group_of, int64_t num_groups, float scale, float *out,
                       int num_threads) {
  return cascade_decode(D, Hkv, R, Dh, rows_per_bias, q, q_d, sk, sv, s_h, s_d, Ls, sbias, pk, pv,
                        p_h, p_g, Lp, pbias, group_of, num_groups, scale, out, num_threads, 0, 0,
                        0);
}

int cascade_decode_bf16(int64_t D, int64_t Hkv, int64_t R, int64_t Dh, int64_t rows_per_bias,
                        const float *q, int64_t q_d, const uint16_t *sk, const uint16_t *sv,
                        int64_t s_h, int64_t s_d, int64_t Ls, const float *sbias,
                        const uint16_t *pk, const uint16_t *pv, int64_t p_h, int64_t p_g,
                        int64_t Lp, const float *pbias, const int64_t *group_of,
                        int64_t num_groups, float scale, float *out, int num_threads) {
  // the prefix scores through bfloat16 dot products or AMX tiles where that changes no
  // product: every q value a bfloat16 (a bfloat16 model's q, widened); decided once per call,
  // so a row's result never depends on how rows are blocked (the number of threads)
  // (scanned only where a path needs it: q may be cold, and the check reads all of it)
  int q_bf16 = (USE_BF16_DOT && Dh % 2 == 0 && Lp > 0) ||
               (HAVE_AMX && Dh % 32 == 0 && Dh <= 128 && Lp >= AMX_MIN_PREFIX &&
                cascade_decode_has_amx());
  for (int64_t d = 0; q_bf16 && d < D; d++) {
    uint32_t low = 0;  // a sequence's rows at a time, no early exit inside: a vector loop
    for (int64_t e = 0; e < Hkv * R * Dh; e++) {
      uint32_t w;
      memcpy(&w, q + d * q_d + e, sizeof w);
      low |= w & 0xFFFFu;
    }
    q_bf16 = low == 0;
  }
  const int dot = USE_BF16_DOT && Dh % 2 == 0 && q_bf16;
  const int amx =
      q_bf16 && Dh % 32 == 0 && Dh <= 128 && Lp >= AMX_MIN_PREFIX && cascade_decode_has_amx();
  return cascade_decode(D, Hkv, R, Dh, rows_per_bias, q, q_d, sk, sv, s_h, s_d, Ls, sbias, pk, pv,
                        p_h, p_g, Lp, pbias, group_of, num_groups, scale, out, num_threads, 1, dot,
                        amx);
}
