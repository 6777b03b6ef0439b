/* wxh64: the CPU checksum of weight sync, fused with the copy that packs a bucket.
 *
 * The function (weight_sync/checksum.py holds the numpy reference and the spec):
 *   bytes -> little-endian 64-bit words w_j (the last one zero-padded), j = 0, 1, ...
 *   d_j  = w_j ^ ((j + 1) * P1)                 position key: swapped or shifted words differ
 *   d_j ^= lo32(lo32(d_j) * M1) << 32            two Feistel rounds: a bijection of w_j,
 *   d_j ^= lo32(hi32(d_j) * M2)                  so any change inside one word changes d_j
 *   V    = sum_j d_j  (mod 2^64)                 ... and therefore V
 *   hash = fmix64(V ^ (nbytes * P4))             murmur3's finalizer, also a bijection
 * Sums are associative, so a buffer may be split at any multiple of 8 bytes and the partial
 * sums (computed with the right starting word index) added: that is how two threads share one
 * tensor. Every function here returns the partial sum V; the caller finalizes.
 *
 * The copy variant streams each vector once: load, hash from the register, store (AVX-512:
 * eight words a vector, the source prefetched ahead; AVX2: four). The AVX-512, AVX2 and scalar
 * loops compute the same sums (tests/weight_sync/test_wxh64.py checks the one built here against
 * the numpy reference). With `nontemporal` the stores bypass the cache (no read-for-ownership
 * of the destination), which saves a third of the DRAM traffic when the destination is not read
 * again soon; without it the copy stays in the cache for the next reader (a streamed bucket,
 * which the receiver's core verifies next, out of the shared last-level cache).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define P1 0x9E3779B97F4A7C15ULL
#define M1 0x85EBCA77ULL
#define M2 0xC2B2AE3DULL

static inline uint64_t mix_word(uint64_t w, uint64_t j) {
    uint64_t d = w ^ ((j + 1) * P1);
    d ^= (((d & 0xffffffffULL) * M1) & 0xffffffffULL) << 32;
    d ^= ((d >> 32) * M2) & 0xffffffffULL;
    return d;
}

static inline uint64_t load_word(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;   /* little-endian host assumed (x86-64, aarch64): checked by the python loader */
}

/* Words [i, n/8) scalar, then the zero-padded tail. */
static uint64_t tail_sum(const uint8_t *src, uint8_t *dst, size_t nbytes, size_t i, uint64_t word0) {
    uint64_t v = 0;
    size_t words = nbytes / 8;
    for (; i < words; i++) {
        uint64_t w = load_word(src + 8 * i);
        if (dst) memcpy(dst + 8 * i, &w, 8);
        v += mix_word(w, word0 + i);
    }
    size_t rest = nbytes - 8 * words;
    if (rest) {
        uint64_t w = 0;
        memcpy(&w, src + 8 * words, rest);
        if (dst) memcpy(dst + 8 * words, src + 8 * words, rest);
        v += mix_word(w, word0 + words);
    }
    return v;
}

#if defined(__AVX512F__)
/* Eight words per vector, two vectors (two cache lines) per step. The source is prefetched
 * PREFETCH_BYTES ahead: one core's hardware prefetchers alone leave its DRAM reads well short
 * of what the memory gives (the sender's pack reads the trainer's weights out of DRAM). */
#define STORE_ALIGN 64
#define PREFETCH_BYTES 1024
static inline __m512i mix8(__m512i w, __m512i key) {
    const __m512i m1 = _mm512_set1_epi64((long long)M1), m2 = _mm512_set1_epi64((long long)M2);
    const __m512i lo32 = _mm512_set1_epi64(0xffffffffLL);
    __m512i d = _mm512_xor_si512(w, key);
    d = _mm512_xor_si512(d, _mm512_slli_epi64(_mm512_mul_epu32(d, m1), 32));
    d = _mm512_xor_si512(d, _mm512_and_si512(_mm512_mul_epu32(_mm512_srli_epi64(d, 32), m2), lo32));
    return d;
}

/* mode 0: hash only; 1: copy with ordinary stores; 2: copy with streaming stores (dst 64-aligned). */
static uint64_t run(const uint8_t *src, uint8_t *dst, size_t nbytes, uint64_t word0, int mode) {
    size_t steps = nbytes / 128;
    /* lane l of k0 keys word word0 + l (the key of word j is (j + 1) * P1), k1 the next eight */
    __m512i k0 = _mm512_set_epi64(
        (long long)((word0 + 8) * P1), (long long)((word0 + 7) * P1), (long long)((word0 + 6) * P1),
        (long long)((word0 + 5) * P1), (long long)((word0 + 4) * P1), (long long)((word0 + 3) * P1),
        (long long)((word0 + 2) * P1), (long long)((word0 + 1) * P1));
    __m512i k1 = _mm512_add_epi64(k0, _mm512_set1_epi64((long long)(8 * P1)));
    const __m512i step = _mm512_set1_epi64((long long)(16 * P1));
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    for (size_t s = 0; s < steps; s++) {
        const uint8_t *p = src + 128 * s;
        _mm_prefetch((const char *)p + PREFETCH_BYTES, _MM_HINT_T0);  /* never faults */
        _mm_prefetch((const char *)p + PREFETCH_BYTES + 64, _MM_HINT_T0);
        __m512i w0 = _mm512_loadu_si512((const void *)p);
        __m512i w1 = _mm512_loadu_si512((const void *)(p + 64));
        if (mode == 1) {
            _mm512_storeu_si512((void *)(dst + 128 * s), w0);
            _mm512_storeu_si512((void *)(dst + 128 * s + 64), w1);
        } else if (mode == 2) {
            _mm512_stream_si512((void *)(dst + 128 * s), w0);
            _mm512_stream_si512((void *)(dst + 128 * s + 64), w1);
        }
        a0 = _mm512_add_epi64(a0, mix8(w0, k0));
        a1 = _mm512_add_epi64(a1, mix8(w1, k1));
        k0 = _mm512_add_epi64(k0, step);
        k1 = _mm512_add_epi64(k1, step);
    }
    if (mode == 2) _mm_sfence();
    uint64_t v = (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a0, a1));
    return v + tail_sum(src, mode ? dst : NULL, nbytes, steps * 16, word0);
}
#elif defined(__AVX2__)
#define STORE_ALIGN 32
static inline __m256i mix4(__m256i w, __m256i key) {
    const __m256i m1 = _mm256_set1_epi64x((long long)M1), m2 = _mm256_set1_epi64x((long long)M2);
    const __m256i lo32 = _mm256_set1_epi64x(0xffffffffLL);
    __m256i d = _mm256_xor_si256(w, key);
    d = _mm256_xor_si256(d, _mm256_slli_epi64(_mm256_mul_epu32(d, m1), 32));
    d = _mm256_xor_si256(d, _mm256_and_si256(_mm256_mul_epu32(_mm256_srli_epi64(d, 32), m2), lo32));
    return d;
}

static inline uint64_t hsum4(__m256i a) {
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, a);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

/* mode 0: hash only; 1: copy with ordinary stores; 2: copy with streaming stores (dst 32-aligned). */
static uint64_t run(const uint8_t *src, uint8_t *dst, size_t nbytes, uint64_t word0, int mode) {
    size_t stripes = nbytes / 64;     /* two 32-byte stripes per step: one cache line */
    __m256i k0 = _mm256_set_epi64x((long long)((word0 + 4) * P1), (long long)((word0 + 3) * P1),
                                   (long long)((word0 + 2) * P1), (long long)((word0 + 1) * P1));
    __m256i k1 = _mm256_add_epi64(k0, _mm256_set1_epi64x((long long)(4 * P1)));
    const __m256i step = _mm256_set1_epi64x((long long)(8 * P1));
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    for (size_t s = 0; s < stripes; s++) {
        const uint8_t *p = src + 64 * s;
        __m256i w0 = _mm256_loadu_si256((const __m256i *)p);
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(p + 32));
        if (mode == 1) {
            _mm256_storeu_si256((__m256i *)(dst + 64 * s), w0);
            _mm256_storeu_si256((__m256i *)(dst + 64 * s + 32), w1);
        } else if (mode == 2) {
            _mm256_stream_si256((__m256i *)(dst + 64 * s), w0);
            _mm256_stream_si256((__m256i *)(dst + 64 * s + 32), w1);
        }
        a0 = _mm256_add_epi64(a0, mix4(w0, k0));
        a1 = _mm256_add_epi64(a1, mix4(w1, k1));
        k0 = _mm256_add_epi64(k0, step);
        k1 = _mm256_add_epi64(k1, step);
    }
    if (mode == 2) _mm_sfence();
    uint64_t v = hsum4(_mm256_add_epi64(a0, a1));
    return v + tail_sum(src, mode ? dst : NULL, nbytes, stripes * 8, word0);
}
#else
static uint64_t run(const uint8_t *src, uint8_t *dst, size_t nbytes, uint64_t word0, int mode) {
    uint64_t v0 = 0, v1 = 0, v2 = 0, v3 = 0;
    size_t quads = nbytes / 32;
    for (size_t q = 0; q < quads; q++) {
        const uint8_t *p = src + 32 * q;
        uint64_t w0 = load_word(p), w1 = load_word(p + 8), w2 = load_word(p + 16), w3 = load_word(p + 24);
        if (mode) memcpy(dst + 32 * q, p, 32);
        uint64_t j = word0 + 4 * q;
        v0 += mix_word(w0, j); v1 += mix_word(w1, j + 1); v2 += mix_word(w2, j + 2); v3 += mix_word(w3, j + 3);
    }
    return v0 + v1 + v2 + v3 + tail_sum(src, mode ? dst : NULL, nbytes, quads * 4, word0);
}
#endif

/* Partial sum V of `nbytes` at `src`, whose first word is word number `word0` of the tensor. */
uint64_t wxh64_sum(const void *src, size_t nbytes, uint64_t word0) {
    return run((const uint8_t *)src, NULL, nbytes, word0, 0);
}

/* Copy `nbytes` from `src` to `dst` (not overlapping) and return the partial sum V of the bytes
 * copied. `nontemporal`: stream the stores past the cache where `dst` allows it. */
uint64_t wxh64_copy_sum(const void *src, void *dst, size_t nbytes, uint64_t word0, int nontemporal) {
    const uint8_t *s = (const uint8_t *)src;
    uint8_t *d = (uint8_t *)dst;
    int mode = 1;
#if defined(__AVX2__)
    if (nontemporal) {
        /* Streaming stores need an aligned destination: copy a head of whole words with
         * ordinary stores until it is, if the misalignment is a whole number of words. */
        size_t head = (STORE_ALIGN - ((uintptr_t)d & (STORE_ALIGN - 1))) & (STORE_ALIGN - 1);
        if (head % 8 == 0 && head <= nbytes) {
            uint64_t v = head ? run(s, d, head, word0, 1) : 0;
            return v + run(s + head, d + head, nbytes - head, word0 + head / 8, 2);
        }
    }
#else
    (void)nontemporal;
#endif
    return run(s, d, nbytes, word0, mode);
}

int wxh64_has_avx2(void) {
#if defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}
