/* Transposing copy for the CPU: dst[c, r] = src[r, c] for a rows x cols matrix of 2-, 4- or
   8-byte elements, both with a leading dimension (the distance in elements between rows).

   It fills a column-major weight (`rollout.model.CausalLM.column_major`: the [out, in] parameter
   is a view of an [in, out] tensor) from the row-major [out, in] tensor a weight update brings.
   torch's strided copy walks one side element by element across rows; here the matrix is cut
   into blocks of ROWS_PER_BLOCK src rows by COLS_PER_BLOCK columns, each into 8 x 8 tiles
   transposed in registers. A block reads a few long runs of src rows (streams the prefetcher
   follows) and writes ROWS_PER_BLOCK consecutive elements of each of its dst rows: whole cache
   lines for 4-byte elements, and the dst lines it touches stay in cache for the block's length.
   Bytes are moved, never converted: the result is bitwise the source. Row blocks are split over
   OpenMP threads (torch's libgomp) for large matrices. */

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

#define ROWS_PER_BLOCK 16
#define COLS_PER_BLOCK 1024
#define PARALLEL_ELEMENTS 262144  // below this, one thread: the fork / join costs more

int transpose_has_avx2(void) { return HAVE_AVX2; }

#if HAVE_AVX2
/* The 8 x 8 tile of 32-bit elements at s (row stride ls) into d (row stride ld), transposed. */
static inline void tile_32(const uint32_t *s, int64_t ls, uint32_t *d, int64_t ld) {
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps((const float *)(s + i * ls));
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; i++) {
    _mm256_storeu_ps((float *)(d + i * ld), _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
    _mm256_storeu_ps((float *)(d + (i + 4) * ld), _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
  }
}

/* The 8 x 8 tile of 16-bit elements, transposed. */
static inline void tile_16(const uint16_t *s, int64_t ls, uint16_t *d, int64_t ld) {
  __m128i a[8], b[8], c[8];
  for (int i = 0; i < 8; i++) a[i] = _mm_loadu_si128((const __m128i *)(s + i * ls));
  for (int i = 0; i < 8; i += 2) {
    b[i] = _mm_unpacklo_epi16(a[i], a[i + 1]);
    b[i + 1] = _mm_unpackhi_epi16(a[i], a[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    c[i] = _mm_unpacklo_epi32(b[i], b[i + 2]);
    c[i + 1] = _mm_unpackhi_epi32(b[i], b[i + 2]);
    c[i + 2] = _mm_unpacklo_epi32(b[i + 1], b[i + 3]);
    c[i + 3] = _mm_unpackhi_epi32(b[i + 1], b[i + 3]);
  }
  for (int i = 0; i < 4; i++) {
    _mm_storeu_si128((__m128i *)(d + 2 * i * ld), _mm_unpacklo_epi64(c[i], c[i + 4]));
    _mm_storeu_si128((__m128i *)(d + (2 * i + 1) * ld), _mm_unpackhi_epi64(c[i], c[i + 4]));
  }
}
#endif

#define SCALAR_TILE(NAME, T)                                                \
  static inline void NAME(const T *s, int64_t ls, T *d, int64_t ld) {      \
    for (int i = 0; i < 8; i++)                                             \
      for (int j = 0; j < 8; j++) d[j * ld + i] = s[i * ls + j];            \
  }
SCALAR_TILE(tile_64, uint64_t)
#if !HAVE_AVX2
SCALAR_TILE(tile_32, uint32_t)
SCALAR_TILE(tile_16, uint16_t)
#endif

#define TRANSPOSE(NAME, T, TILE)                                                                 \
  static void NAME(const T *src, int64_t ls, T *dst, int64_t ld, int64_t rows, int64_t cols,    \
                   int num_threads) {                                                           \
    const int64_t row_blocks = (rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;                     \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (rows * cols >= PARALLEL_ELEMENTS)") \
    for (int64_t rb = 0; rb < row_blocks; rb++) {                                               \
      const int64_t r0 = rb * ROWS_PER_BLOCK;                                                   \
      const int64_t r1 = r0 + ROWS_PER_BLOCK < rows ? r0 + ROWS_PER_BLOCK : rows;               \
      for (int64_t c0 = 0; c0 < cols; c0 += COLS_PER_BLOCK) {                                   \
        const int64_t c1 = c0 + COLS_PER_BLOCK < cols ? c0 + COLS_PER_BLOCK : cols;             \
        int64_t r = r0;                                                                         \
        for (; r + 8 <= r1; r += 8) {                                                           \
          int64_t c = c0;                                                                       \
          for (; c + 8 <= c1; c += 8) TILE(src + r * ls + c, ls, dst + c * ld + r, ld);         \
          for (; c < c1; c++)                                                                   \
            for (int64_t k = r; k < r + 8; k++) dst[c * ld + k] = src[k * ls + c];              \
        }                                                                                       \
        for (int64_t c = c0; c < c1; c++)                                                       \
          for (int64_t k = r; k < r1; k++) dst[c * ld + k] = src[k * ls + c];                   \
      }                                                                                         \
    }                                                                                           \
  }
TRANSPOSE(transpose_16, uint16_t, tile_16)
TRANSPOSE(transpose_32, uint32_t, tile_32)
TRANSPOSE(transpose_64, uint64_t, tile_64)

/* dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols; returns -1 (nothing
   written) for an element size other than 2, 4 or 8. */
int transpose_copy(const void *src, int64_t ld_src, void *dst, int64_t ld_dst, int64_t rows,
                   int64_t cols, int64_t element_size, int num_threads) {
  switch (element_size) {
    case 2: transpose_16(src, ld_src, dst, ld_dst, rows, cols, num_threads); return 0;
    case 4: transpose_32(src, ld_src, dst, ld_dst, rows, cols, num_threads); return 0;
    case 8: transpose_64(src, ld_src, dst, ld_dst, rows, cols, num_threads); return 0;
    default: return -1;
  }
}

/* Streaming copy: dst[0, nbytes) = src[0, nbytes), the stores bypassing the cache (no
   read-for-ownership of dst, so a third less memory traffic than an ordinary copy). For a
   weight update, whose destination (the engine's parameters) is not read again until the next
   forward pass and is larger than the cache: what `rollout.weights.copy_into` runs for large
   plain copies. One thread: on a busy 2-core box a fork / join of two threads stalls on the
   slower one, and one thread's streaming copy already moves what the memory takes. */
void stream_copy(const void *src, void *dst, int64_t nbytes) {
  const uint8_t *s = (const uint8_t *)src;
  uint8_t *d = (uint8_t *)dst;
#if defined(__AVX512F__) || HAVE_AVX2
  size_t n = (size_t)nbytes;
  size_t head = (64 - ((uintptr_t)d & 63)) & 63;  /* streaming stores want aligned lines */
  if (head > n) head = n;
  memcpy(d, s, head);
  s += head, d += head, n -= head;
  size_t lines = n / 64;
  for (size_t i = 0; i < lines; i++) {
#if defined(__AVX512F__)
    _mm512_stream_si512((void *)(d + 64 * i), _mm512_loadu_si512((const void *)(s + 64 * i)));
#else
    __m256i a = _mm256_loadu_si256((const __m256i *)(s + 64 * i));
    __m256i b = _mm256_loadu_si256((const __m256i *)(s + 64 * i + 32));
    _mm256_stream_si256((__m256i *)(d + 64 * i), a);
    _mm256_stream_si256((__m256i *)(d + 64 * i + 32), b);
#endif
  }
  _mm_sfence();  /* the streamed lines are visible before the caller goes on */
  memcpy(d + 64 * lines, s + 64 * lines, n - 64 * lines);
#else
  memcpy(d, s, (size_t)nbytes);
#endif
}
