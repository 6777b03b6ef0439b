"""The two builds each C kernel of `rollout.native` is tested in: the one the engine loads
(-march=native: AVX2 + FMA where the CPU has them) and, on x86-64, the portable one (the x86-64
baseline, no AVX2), whose plain C loops compute the same function."""

from __future__ import annotations

import platform

from rollout import native

PORTABLE_FLAGS = [f if f != "-march=native" else "-march=x86-64" for f in native.FLAGS]


def builds(library) -> dict:
    """{"native": the engine's build, "portable": the baseline build (x86-64 only)}."""
    found = {"native": library()}
    if platform.machine() == "x86_64":
        found["portable"] = library.build(PORTABLE_FLAGS)
    return found
