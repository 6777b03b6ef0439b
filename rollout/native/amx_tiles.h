/* AMX tiles for the C kernels that use them (prefill_attention.c, cascade_decode.c,
   small_gemm.c): whether a build has them (HAVE_AMX: AMX-TILE and AMX-BF16 besides AVX-512
   BF16, the including file's HAVE_BF16_DOT), whether this process may use them (amx_usable),
   the tile configuration they use (amx_configure: tiles 0-5, each 16 rows x 64 bytes), and the
   P V tile product of both attention kernels (amx_dot_values, amx_store_c).

   AMX state is a process permission on Linux (arch_prctl ARCH_REQ_XCOMP_PERM): amx_usable()
   asks once, and with CPUID confirms the CPU has the tiles, so a build run where either is
   missing takes its AVX-512 path. The including file defines _GNU_SOURCE before any include
   (syscall under -std=c11). */
#ifndef MILES_LIKE_AMX_TILES_H
#define MILES_LIKE_AMX_TILES_H

#if HAVE_BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#if HAVE_AMX
#include <cpuid.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };

static int amx_usable(void) {
  static int state = -1;  // asked once per process; a racing second ask gets the same answer
  if (state < 0) {
    unsigned a, b, c, d;
    const int cpu = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 22 & 1);
    state = cpu && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }
  return state;
}

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

static void amx_configure(void) {
  tile_config cfg = {0};
  cfg.palette = 1;
  for (int t = 0; t < 6; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

/* Applies F(j) for the C tiles j < NC (NC <= 4), with j an immediate (tile numbers are). */
#define FOR_TILES(NC, F) \
  do {                   \
    F(0);                \
    if ((NC) > 1) F(1);  \
    if ((NC) > 2) F(2);  \
    if ((NC) > 3) F(3);  \
  } while (0)

/* The P V tile product of both attention kernels, on values as key pairs (vw: keys 2k, 2k + 1
   of column x at word k * Dh + x): C tiles j < NC += A (tile 4: 16 rows x 32 keys of P) times
   the values of keys 32 u .. 32 u + 31, columns c + 16 j (each a B tile, in tile 5). */
static inline __attribute__((always_inline)) void amx_dot_values(int NC, const uint32_t *vw,
                                                                 int64_t u, int64_t c,
                                                                 int64_t Dh) {
#define DOT(j)                                               \
  do {                                                       \
    _tile_loadd(5, vw + 16 * u * Dh + c + 16 * (j), Dh * 4); \
    _tile_dpbf16ps(j, 4, 5);                                 \
  } while (0)
  FOR_TILES(NC, DOT);
#undef DOT
}

/* C tiles j < NC stored to the 16 rows at oc (Dh floats apart), from column 16 j. */
static inline __attribute__((always_inline)) void amx_store_c(int NC, float *oc, int64_t Dh) {
#define STORE(j) _tile_stored(j, oc + 16 * (j), Dh * 4)
  FOR_TILES(NC, STORE);
#undef STORE
}
#endif

#endif
