"""The C heap of a process whose engine runs on the CPU: memory a forward pass frees is kept
mapped for the next one instead of going back to the kernel.

A forward pass allocates and frees its intermediates (tens of MiB at prefill sizes) every time.
glibc's malloc gives a block above its mmap threshold its own mapping, unmapped on free, and
returns the heap's free top to the kernel past its trim threshold. Both thresholds follow the
largest block freed so far, but within one forward the heap's free top still swings past the
trim threshold, so the next forward's intermediates land on fresh pages: a page fault and a
zeroed page per 4 KiB, thousands per prefill forward. Fixed thresholds keep those pages:
blocks up to `MMAP_THRESHOLD` (glibc's largest) come from the heap and stay there, and up to
`TRIM_THRESHOLD` of free heap top stays mapped. Larger blocks (a big model's weights, the KV
pool) are still mapped on their own and unmapped when freed, so `Engine.release_memory` still
hands their memory back.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc refuses larger (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 256 << 20


def keep_freed_memory() -> bool:
    """Fix this process's malloc thresholds as above; returns whether the C library took them
    (False where it has no `mallopt`, e.g. not glibc). Process-wide and idempotent."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    )
