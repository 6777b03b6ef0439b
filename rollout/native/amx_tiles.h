/* AMX tiles for the C kernels that use them (prefill_attention.c, small_gemm.c): whether a
   build has them (HAVE_AMX: AMX-TILE and AMX-BF16 besides AVX-512 BF16, the including file's
   HAVE_BF16_DOT), whether this process may use them (amx_usable) and the tile configuration
   both kernels use (amx_configure: tiles 0-5, each 16 rows x 64 bytes).

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
#endif

#endif
