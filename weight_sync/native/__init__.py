"""The native wxh64 kernel (wxh64.c): copy + checksum in one pass, and checksum alone.

Built on first use and loaded by `native_build` (a private cache keyed by the source, the flags,
the compiler and this CPU). ctypes releases the GIL during the call, so two threads can each run
half of a large tensor. Without it (no compiler, MILES_LIKE_NATIVE=0, an unsafe cache directory)
`kernel()` returns None after one warning and weight sync falls back to xxh3.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import native_build

SOURCE = Path(__file__).with_name("wxh64.c")
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c11"]


def library_name(cc: str) -> str:
    """The cached library's file name (see `native_build.library_name`)."""
    return native_build.library_name(SOURCE, FLAGS, cc)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.wxh64_sum.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64]
    lib.wxh64_sum.restype = ctypes.c_uint64
    lib.wxh64_copy_sum.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_uint64,
        ctypes.c_int,
    ]
    lib.wxh64_copy_sum.restype = ctypes.c_uint64
    lib.wxh64_has_avx2.restype = ctypes.c_int
    return lib


kernel = native_build.LazyLibrary(
    SOURCE,
    FLAGS,
    _declare,
    "weight_sync: native wxh64 kernel",
    "using xxh3 checksums and torch copies, about 1.5x slower syncs.",
)
"""The loaded kernel, building it on first use; None (one warning) if that is impossible."""
